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
    {"$ints": [offset, size]}               a list of PACK_MIN or more ints, as int64 in the raw part
    {"$floats": [offset, size]}             a list of PACK_MIN or more floats, as float64 in the raw part
    {"$tensor": [dtype, shape, offset, size]}  a CPU tensor (contiguous, its bytes in the raw part)
    {"$items": [[key, value], ...]}         a dict with a key that is not a str, or whose
                                            one key starts with "$" (never read as a tag)
    {"$data": [name, {field: value}]}       a registered dataclass
    {"$table": [name, {field: column}]}     a list of instances of one registered dataclass,
                                            a column (a list) per field
    {"$ragged": [tag, lengths, values]}     a list of lists of ints ("$ints") or of floats
                                            ("$floats"): the lengths as an "$ints" span, the
                                            values one after another as a span of that tag

Raw numbers are in the machine's byte order, as tensors are (little-endian on
every platform torch builds for).
"""

from __future__ import annotations

import dataclasses
import json
import struct
from array import array
from itertools import accumulate, chain

import numpy as np
import torch

# The dataclasses a message may hold, by the name they travel under (`register`).
DATACLASSES: dict[str, type] = {}
_FIELDS: dict[type, tuple[str, ...]] = {}  # a registered class -> its fields (all __init__ arguments)
_JSON_LEAVES = frozenset({type(None), bool, int, float, str})
# A list of at least this many ints or floats travels as raw int64 / float64 (JSON
# writes a float in about 0.3 us, a message of 64 samples' log-probs in milliseconds).
PACK_MIN = 8
_PACKABLE = {int: ("$ints", "q"), float: ("$floats", "d")}
_PACKED = dict(_PACKABLE.values())
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
    arrives only as a `cls(**fields)` with exactly its fields. ValueError for a
    class that is not a dataclass, has a field that is not an __init__ argument,
    or whose name another class holds."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ValueError(f"wire.register takes a dataclass, got {cls!r}")
    not_init = [f.name for f in dataclasses.fields(cls) if not f.init]
    if not_init:
        raise ValueError(f"wire.register: {cls.__qualname__}'s fields {not_init} are not __init__ arguments: an "
                         "instance could not be rebuilt from what travels")
    held = DATACLASSES.setdefault(cls.__name__, cls)
    if held is not cls:
        raise ValueError(f"wire.register: the name {cls.__name__!r} is {held.__module__}.{held.__qualname__}'s, "
                         f"not {cls.__module__}.{cls.__qualname__}'s")
    _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return cls


def encode(message) -> bytes:
    """The bytes of `message`; TypeError naming the first value that is not data."""
    raw: list[bytes] = []
    size = [0]

    def blob(data: bytes) -> tuple[int, int]:
        raw.append(data)
        size[0] += len(data)
        return size[0] - len(data), len(data)

    def ragged(values: list):
        """Lists of ints (or of floats) as their lengths and one run of raw values;
        None if they hold anything else."""
        flat = list(chain.from_iterable(values))
        packed = _raw(flat, set(map(type, flat)))
        if packed is None:
            return None
        tag, data = packed
        return {"$ragged": [tag, list(blob(array("q", map(len, values)).tobytes())), list(blob(data))]}

    def tree(value):
        # The common cases first, by exact type: what JSON writes as it is (a list of
        # token ids or log-probs is most of a message's values, copied in one pass).
        kind = type(value)
        if kind in _JSON_LEAVES:
            return value
        if kind is list:
            kinds = set(map(type, value))
            if kinds == {list} and (packed := ragged(value)) is not None:
                return packed
            if len(kinds) == 1 and _FIELDS.get(next(iter(kinds))):  # rows of one dataclass: a column per field
                row = next(iter(kinds))
                return {"$table": [row.__name__, {name: tree([getattr(v, name) for v in value])
                                                  for name in _FIELDS[row]}]}
            if len(value) >= PACK_MIN and (packed := _raw(value, kinds)) is not None:
                tag, data = packed
                return {tag: list(blob(data))}
            return value if kinds <= _JSON_LEAVES else [tree(v) for v in value]
        if kind is dict and _str_keyed(value):
            return {k: tree(v) for k, v in value.items()}
        if kind in _FIELDS:
            return {"$data": [kind.__name__, {name: tree(getattr(value, name)) for name in _FIELDS[kind]}]}
        return other(value)

    def other(value):
        if isinstance(value, np.generic) and not isinstance(value, (np.void, np.object_)):
            value = value.item()  # a numpy scalar (a metric a user's hook computed): its Python value
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, (int, float)):  # bool is caught above; an int or float subclass becomes the plain type
            return int(value) if isinstance(value, int) else float(value)
        if isinstance(value, list):
            return [tree(v) for v in value]
        if isinstance(value, tuple):
            return {"$tuple": [tree(v) for v in value]}
        if isinstance(value, dict):
            if _str_keyed(value):
                return {k: tree(v) for k, v in value.items()}
            return {"$items": [[tree(k), tree(v)] for k, v in value.items()]}
        if isinstance(value, (bytes, bytearray)):
            return {"$bytes": list(blob(bytes(value)))}
        if isinstance(value, torch.Tensor):
            name = str(value.dtype).removeprefix("torch.")
            if name not in DTYPES:
                raise _NotData(value, f"a tensor of dtype {value.dtype} (messages carry {sorted(DTYPES)})")
            flat = value.detach().to("cpu").contiguous().reshape(-1)
            data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
            return {"$tensor": [name, list(value.shape), *blob(data)]}
        raise _NotData(value, f"a {type(value).__module__}.{type(value).__qualname__} (messages carry data only: "
                              f"None, bool, int, float, str, bytes, list, tuple, dict, torch.Tensor, "
                              f"{', '.join(DATACLASSES)})")

    try:
        header = json.dumps(tree(message), separators=(",", ":")).encode()
    except _NotData as refused:
        raise TypeError(f"cannot send {_where(message, refused.value, 'the message')}: {refused.why}") from None
    return b"".join([_LENGTH.pack(len(header)), header, *raw])


def _raw(values: list, kinds: set) -> tuple[str, bytes] | None:
    """(tag, raw bytes) of `values` if all are ints (within int64) or all floats,
    exactly those types (`kinds`: their types; none, for no values: ints), else None."""
    if len(kinds) > 1 or not kinds <= _PACKABLE.keys():
        return None
    tag, code = _PACKABLE[next(iter(kinds), int)]
    try:
        return tag, array(code, values).tobytes()
    except OverflowError:
        return None  # an int beyond int64: JSON's ints have no bound


def _str_keyed(value: dict) -> bool:
    """Whether JSON writes `value` as itself: str keys, and not one key that reads as a tag."""
    return all(isinstance(k, str) for k in value) and not (len(value) == 1 and next(iter(value)).startswith("$"))


class _NotData(Exception):
    def __init__(self, value, why: str):
        self.value, self.why = value, why


def _where(node, target, where: str) -> str | None:
    """Where `target` (by identity) sits in `node`, as encode's error names it."""
    if node is target:
        return where
    if isinstance(node, (list, tuple)):
        children = [(f"{where}[{i}]", v) for i, v in enumerate(node)]
    elif isinstance(node, dict):
        children = [c for k, v in node.items() for c in ((f"{where} key {k!r}", k), (f"{where}[{k!r}]", v))]
    elif type(node) in _FIELDS:
        children = [(f"{where}.{name}", getattr(node, name)) for name in _FIELDS[type(node)]]
    else:
        return None
    for path, child in children:
        found = _where(child, target, path)
        if found is not None:
            return found
    return None


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
    kind = type(node)
    if kind is list:  # json builds lists, dicts, None, bool, int, float and str only
        return node if set(map(type, node)) <= _JSON_LEAVES else [_tree(v, raw) for v in node]
    if kind is not dict:
        return node
    if not (len(node) == 1 and next(iter(node)).startswith("$")):
        return {k: _tree(v, raw) for k, v in node.items()}
    (tag, body), = node.items()
    if tag == "$tuple" and isinstance(body, list):
        return tuple(_tree(v, raw) for v in body)
    if tag == "$items" and isinstance(body, list) and all(isinstance(p, list) and len(p) == 2 for p in body):
        return {_tree(k, raw): _tree(v, raw) for k, v in body}
    if tag == "$bytes" and isinstance(body, list) and len(body) == 2:
        return bytes(_span(raw, *body))
    if tag in _PACKED and isinstance(body, list) and len(body) == 2:
        return _packed(tag, body, raw)
    if tag == "$ragged" and isinstance(body, list) and len(body) == 3 and body[0] in _PACKED:
        lengths, values = _packed("$ints", body[1], raw), _packed(body[0], body[2], raw)
        if min(lengths, default=0) < 0 or sum(lengths) != len(values):
            raise WireError(f"$ragged lengths {lengths[:8]}... for {len(values)} values")
        return [values[stop - n : stop] for n, stop in zip(lengths, accumulate(lengths))]
    if tag == "$table" and isinstance(body, list) and len(body) == 2 and isinstance(body[1], dict):
        cls = _registered(body[0], body[1])
        columns = {k: _tree(v, raw) for k, v in body[1].items()}
        if not all(type(c) is list for c in columns.values()) or len(set(map(len, columns.values()))) > 1:
            raise WireError(f"a $table of {body[0]!r} whose columns are not lists of one length")
        return [cls(**dict(zip(columns, row))) for row in zip(*columns.values())]
    if tag == "$tensor" and isinstance(body, list) and len(body) == 4:
        return _tensor(*body, raw)
    if tag == "$data" and isinstance(body, list) and len(body) == 2 and isinstance(body[1], dict):
        return _dataclass(body[0], {k: _tree(v, raw) for k, v in body[1].items()})
    raise WireError(f"an unknown or malformed tag {tag!r}")


def _packed(tag: str, body, raw: memoryview) -> list:
    values = array(_PACKED[tag])
    if not (isinstance(body, list) and len(body) == 2):
        raise WireError(f"a {tag} span {body!r}")
    span = _span(raw, *body)
    if len(span) % values.itemsize:
        raise WireError(f"{tag} of {len(span)} bytes: not whole {values.itemsize}-byte values")
    values.frombytes(span)
    return values.tolist()


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


def _registered(name, fields: dict) -> type:
    """The registered dataclass `name`, if `fields` are exactly its fields."""
    cls = DATACLASSES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise WireError(f"an unknown dataclass {name!r}")
    if fields.keys() != set(_FIELDS[cls]):
        raise WireError(f"a {name} with fields {sorted(fields)} (it has {sorted(_FIELDS[cls])})")
    return cls


def _dataclass(name, fields: dict):
    """The registered dataclass `name` built from its decoded `fields`."""
    return _registered(name, fields)(**fields)
