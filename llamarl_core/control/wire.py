"""Control messages as data only: what arrives is parsed, never run.

A message is a tree of None, bool, int, float, str, bytes, list, tuple, dict,
torch.Tensor and the dataclasses registered here (`register`, by the code that
defines them: the pipeline registers its Sample) (a numpy scalar is sent as its
Python value). `encode` refuses anything
else (naming where it sits in the message), so what one side sends the other gets
back as the same tree; `decode` builds only those types, from JSON and raw bytes,
and raises WireError on anything it does not describe. Nothing is imported,
called or unpickled on the way in.

Layout: a 4-byte big-endian length, that many bytes of JSON, then the raw bytes
of every bytes value and tensor, one after another. In the JSON, lists, strings,
numbers (NaN and infinities as Python's json writes them) and str-keyed dicts are
themselves; the rest are one-key objects whose key starts with "$":

    {"$tuple": [...]}                       a tuple
    {"$bytes": [offset, size]}              bytes, in the raw part
    {"$tensor": [dtype, shape, offset, size]}  a CPU tensor (contiguous, its bytes in the raw part)
    {"$items": [[key, value], ...]}         a dict with a key that is not a str, or whose
                                            one key starts with "$" (never read as a tag)
    {"$data": [name, {field: value}]}       a registered dataclass
"""

from __future__ import annotations

import dataclasses
import json
import struct

import numpy as np
import torch

# The dataclasses a message may hold, by the name they travel under (`register`).
DATACLASSES: dict[str, type] = {}
DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                  torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2)
}
_LENGTH = struct.Struct(">I")


class WireError(ValueError):
    """Bytes that are not a message this module writes."""


def register(cls: type) -> type:
    """Let messages carry instances of the dataclass `cls`, under its class name;
    returns `cls` (a decorator). Its fields travel as any other value, and one
    arrives only as a `cls(**fields)` with exactly its init fields. ValueError
    for a class that is not a dataclass, or whose name another class holds."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ValueError(f"wire.register takes a dataclass, got {cls!r}")
    held = DATACLASSES.setdefault(cls.__name__, cls)
    if held is not cls:
        raise ValueError(f"wire.register: the name {cls.__name__!r} is {held.__module__}.{held.__qualname__}'s, "
                         f"not {cls.__module__}.{cls.__qualname__}'s")
    return cls


def encode(message) -> bytes:
    """The bytes of `message`; TypeError naming the first value that is not data."""
    raw: list[bytes] = []
    size = [0]

    def blob(data: bytes) -> tuple[int, int]:
        raw.append(data)
        size[0] += len(data)
        return size[0] - len(data), len(data)

    def tree(value, where: str):
        if isinstance(value, np.generic) and not isinstance(value, (np.void, np.object_)):
            value = value.item()  # a numpy scalar (a metric a user's hook computed): its Python value
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, (int, float)):  # bool is caught above; an int or float subclass becomes the plain type
            return int(value) if isinstance(value, int) else float(value)
        if isinstance(value, list):
            return [tree(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return {"$tuple": [tree(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, dict):
            if all(isinstance(k, str) for k in value) and not (len(value) == 1 and next(iter(value)).startswith("$")):
                return {k: tree(v, f"{where}[{k!r}]") for k, v in value.items()}
            return {"$items": [[tree(k, f"{where} key {k!r}"), tree(v, f"{where}[{k!r}]")] for k, v in value.items()]}
        if isinstance(value, (bytes, bytearray)):
            return {"$bytes": list(blob(bytes(value)))}
        if isinstance(value, torch.Tensor):
            name = str(value.dtype).removeprefix("torch.")
            if name not in DTYPES:
                raise TypeError(f"cannot send {where}: a tensor of dtype {value.dtype} (messages carry {sorted(DTYPES)})")
            flat = value.detach().to("cpu").contiguous().reshape(-1)
            data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
            return {"$tensor": [name, list(value.shape), *blob(data)]}
        if dataclasses.is_dataclass(value) and DATACLASSES.get(type(value).__name__) is type(value):
            fields = {f.name: tree(getattr(value, f.name), f"{where}.{f.name}") for f in dataclasses.fields(value)}
            return {"$data": [type(value).__name__, fields]}
        raise TypeError(f"cannot send {where}: a {type(value).__module__}.{type(value).__qualname__} (messages carry "
                        f"data only: None, bool, int, float, str, bytes, list, tuple, dict, torch.Tensor, "
                        f"{', '.join(DATACLASSES)})")

    header = json.dumps(tree(message, "the message"), separators=(",", ":")).encode()
    return b"".join([_LENGTH.pack(len(header)), header, *raw])


def decode(data: bytes):
    """The message `encode` wrote into `data`; WireError if `data` is anything else."""
    if len(data) < _LENGTH.size:
        raise WireError(f"{len(data)} bytes: shorter than a message's length field")
    (length,) = _LENGTH.unpack_from(data)
    if _LENGTH.size + length > len(data):
        raise WireError(f"the header claims {length} bytes, {len(data) - _LENGTH.size} follow")
    raw = memoryview(data)[_LENGTH.size + length:]
    try:
        header = json.loads(bytes(data[_LENGTH.size : _LENGTH.size + length]))
        return _tree(header, raw)
    except WireError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, RecursionError, RuntimeError) as exc:
        raise WireError(f"not a message: {type(exc).__name__}: {exc}") from None


def _span(raw: memoryview, offset, size) -> memoryview:
    if not (_is_int(offset) and _is_int(size) and 0 <= offset and 0 <= size and offset + size <= len(raw)):
        raise WireError(f"a raw span [{offset!r}, +{size!r}] outside the message's {len(raw)} raw bytes")
    return raw[offset : offset + size]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _tree(node, raw: memoryview):
    if isinstance(node, list):
        return [_tree(v, raw) for v in node]
    if not isinstance(node, dict):
        return node  # None, bool, int, float, str: json builds nothing else
    if not (len(node) == 1 and next(iter(node)).startswith("$")):
        return {k: _tree(v, raw) for k, v in node.items()}
    (tag, body), = node.items()
    if tag == "$tuple" and isinstance(body, list):
        return tuple(_tree(v, raw) for v in body)
    if tag == "$items" and isinstance(body, list) and all(isinstance(p, list) and len(p) == 2 for p in body):
        return {_tree(k, raw): _tree(v, raw) for k, v in body}
    if tag == "$bytes" and isinstance(body, list) and len(body) == 2:
        return bytes(_span(raw, *body))
    if tag == "$tensor" and isinstance(body, list) and len(body) == 4:
        return _tensor(*body, raw)
    if tag == "$data" and isinstance(body, list) and len(body) == 2 and isinstance(body[1], dict):
        return _dataclass(body[0], body[1], raw)
    raise WireError(f"an unknown or malformed tag {tag!r}")


def _tensor(dtype, shape, offset, size, raw: memoryview) -> torch.Tensor:
    if dtype not in DTYPES:
        raise WireError(f"a tensor of unknown dtype {dtype!r}")
    if not (isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)):
        raise WireError(f"a tensor of shape {shape!r}")
    dtype = DTYPES[dtype]
    numel = 1
    for d in shape:
        numel *= d
    data = _span(raw, offset, size)
    if size != numel * dtype.itemsize:
        raise WireError(f"a {dtype} tensor of shape {shape} in {size} bytes")
    if not numel:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def _dataclass(name, fields: dict, raw: memoryview):
    cls = DATACLASSES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise WireError(f"an unknown dataclass {name!r}")
    wanted = {f.name for f in dataclasses.fields(cls) if f.init}
    if set(fields) != wanted:
        raise WireError(f"a {name} with fields {sorted(fields)} (it has {sorted(wanted)})")
    return cls(**{k: _tree(v, raw) for k, v in fields.items()})
