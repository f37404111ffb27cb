"""The trainer's checkpoints: torch.distributed.checkpoint (DCP) folders in
safetensors, each trainer rank writing its own shards and reading back its
own (at the same or another world size: DCP reshards), no rank ever holding
the whole model or optimizer state.

Layout of a run folder's `checkpoint/`:
- `trainer.json`: the commit record, replaced atomically once every rank's
  shards are on disk: {"format", "step", "data_position", "world", "folder",
  "serial"}. A crash before it is replaced leaves the previous checkpoint whole.
- `<serial>-step-<step>/`: the committed DCP folder, each rank's shards in
  `shard-<rank>-model-<i>-of-<n>.safetensors` files of about 256 MiB (DCP's
  writer builds each file in memory, twice: a rank's save holds about 512 MiB
  beside its state), holding `model/<fqn>` (the float32 master
  weights; a tied parameter once) and `optimizer/<fqn>/<stat>` (AdamW's
  moments and step). The optimizer's hyper-parameters are the run's config, not
  saved. Rank 0 renames it from `.partial` only after checking that it holds
  every key whole (every rank's pieces where rank 0 sees them).
- `reference/`: the KL reference's weights (`model/<fqn>`, the run's compute
  dtype), written once when RL starts.
Nothing in it is a pickle: DCP's safetensors reader builds its metadata from
the files' JSON headers, and the commit record is JSON.

The folder must be one filesystem every trainer rank sees (every rank writes
its shards there): checked when the trainer starts (rank 0 writes a random
token, every rank must read it) and again at each commit."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..models.sharded import few_names, tied_aliases

FORMAT = "llamarl-dcp-safetensors/1"
_GROUP_BYTES = 1 << 30  # export reads and writes the policy this many bytes at a time
# A rank's checkpoint file holds about this many bytes. DCP's HuggingFaceStorageWriter
# builds each file with safetensors.torch.save, which holds it twice in memory (peak
# growth measured at 2x the file with safetensors 0.8): a rank's save holds about
# 512 MiB beside its state, where files of 1 GiB held 2 GiB. SmolLM2-135M's final
# checkpoint (1.6 GB with AdamW's state) into /dev/shm here: 8.3 s, 9.6 s with 1 GiB.
_FILE_BYTES = 256 << 20


def checkpoint_dir(run_dir: str | Path) -> Path:
    """Where a run's trainer keeps its checkpoints."""
    return Path(run_dir) / "checkpoint"


def checkpoint_info(run_dir: str | Path) -> dict | None:
    """The commit record of `run_dir`'s last checkpoint, None before the first.
    ValueError naming the file for a checkpoint of another format (an earlier
    llamarl's `trainer.pt`, one torch.save file), a record that is not one (not
    JSON, a field missing or of another type), a record whose folder is gone, or
    committed step folders with no record (lost: a fresh start would delete them)."""
    folder = checkpoint_dir(run_dir)
    record = folder / "trainer.json"
    if not record.is_file():
        if (folder / "trainer.pt").is_file():
            raise ValueError(f"{folder / 'trainer.pt'} is an earlier llamarl's checkpoint (one torch.save file); this "
                             "version writes and reads torch.distributed.checkpoint folders: start the run anew")
        committed = sorted(p.name for p in folder.glob("*-step-*") if p.is_dir() and not p.name.endswith(".partial"))
        if committed:
            raise ValueError(f"{folder} holds checkpoint {committed[-1]} but no record of it ({record.name} is "
                             "missing: lost, or the run stopped before it recorded its first checkpoint); nothing "
                             "resumes from it: move the folder away to start the run anew")
        return None
    try:
        info = json.loads(record.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{record}: not a checkpoint record (not JSON: {exc})") from None
    if not isinstance(info, dict):
        raise ValueError(f"{record}: not a checkpoint record (a JSON object), got {type(info).__name__}")
    if info.get("format") != FORMAT:
        raise ValueError(f"{record}: format {info.get('format')!r}, this version reads {FORMAT!r}")
    for key in ("step", "data_position", "world", "serial"):
        if isinstance(info.get(key), bool) or not isinstance(info.get(key), int) or info[key] < 0:
            raise ValueError(f"{record}: not a checkpoint record ({key} must be an integer >= 0, got "
                             f"{info.get(key)!r})")
    name = info.get("folder")
    if (not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name
            or not (folder / name).is_dir()):
        raise ValueError(f"{record} names {name!r}, which is not a folder in {folder}")
    return info


def _flat_state(model, optimizer=None) -> tuple[dict[str, torch.Tensor], dict, dict | None]:
    """The model's (and optimizer's) sharded state as one flat {key: tensor} of
    the live tensors (DCP reads into and writes from them; a tied parameter once,
    under its first name), and the model's and optimizer's state dicts those
    tensors belong to."""
    model_state = get_model_state_dict(model)
    second = tied_aliases(model)
    flat = {f"model/{k}": v for k, v in model_state.items() if k not in second}
    if optimizer is None:
        return flat, model_state, None
    optim_state = get_optimizer_state_dict(model, optimizer)
    for fqn, stats in optim_state["state"].items():
        for stat, value in stats.items():
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"optimizer state {fqn}/{stat} is a {type(value).__name__}, not a tensor: "
                                 "a checkpoint holds tensors only")
            flat[f"optimizer/{fqn}/{stat}"] = value
    return flat, model_state, optim_state


def _fsync_json(path: Path, value: dict) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns on every single-process save or load, which here is chosen (one
    trainer rank, or export in one process)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _agree(world: int, failure: str | None, what: str) -> None:
    """Raise on every rank when `failure` (this rank's reason, None when it did its
    part) is set on any rank: a MIN all-reduce of a CPU flag (gloo, also under
    "cpu:gloo,cuda:nccl"), so no rank waits for a rank that gave up."""
    ok = failure is None
    if world > 1:
        import torch.distributed as dist

        flag = torch.tensor([int(ok)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        ok = bool(flag.item())
    if not ok:
        raise RuntimeError(f"{what}: {failure or 'another trainer rank failed (its error names why)'}")


def _attempt(action) -> str | None:
    """Run `action()`; the error it raised, as text, or None."""
    try:
        action()
    except Exception as exc:  # reported to every rank by _agree, then raised there
        return f"{type(exc).__name__}: {exc}"
    return None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _file_index(flat: dict, world: int) -> dict[str, int]:
    """Key -> file number (from 1): keys in order, a file about _FILE_BYTES a rank,
    so that DCP's writer, which builds each file in memory, never holds a rank's
    whole state twice."""
    index, number, size = {}, 1, 0
    for key, t in flat.items():
        nbytes = t.numel() * t.element_size() / world
        if size and size + nbytes > _FILE_BYTES:
            number, size = number + 1, 0
        index[key] = number
        size += nbytes
    return index


def checkpoint_metadata(folder: Path) -> dict:
    """The DCP folder's tensors ({key: their metadata}), read from its files'
    headers. ValueError naming the folder when they cannot be read (a file cut
    short or replaced, a folder replaced by a newer checkpoint meanwhile)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    try:
        return HuggingFaceStorageReader(str(folder)).read_metadata().state_dict_metadata
    except Exception as exc:  # safetensors' and DCP's own errors
        raise _unreadable(folder, exc) from None


def _unreadable(folder: Path, exc: Exception) -> ValueError:
    return ValueError(f"{folder}: its files cannot be read ({type(exc).__name__}: {exc})")


def _uncovered(folder: Path, expected: dict[str, torch.Size]) -> list[str]:
    """The keys of `expected` (key -> global shape) that the DCP folder `folder`
    lacks, holds in another shape, or holds only in part (the saved pieces cover
    fewer elements than the tensor: a rank's file missing)."""
    saved = checkpoint_metadata(folder)
    bad = []
    for key, shape in expected.items():
        meta = saved.get(key)
        covered = sum(math.prod(c.sizes) for c in meta.chunks) if meta is not None else 0
        if meta is None:
            bad.append(f"{key} (absent)")
        elif covered != math.prod(shape):  # the reader's size is the pieces' extent: a missing piece shrinks it
            bad.append(f"{key} (pieces cover {covered} of {math.prod(shape)} elements)")
        elif tuple(meta.size) != tuple(shape):
            bad.append(f"{key} (shaped {list(meta.size)}, here {list(shape)})")
    return bad


def _write(folder: Path, flat: dict, rank: int, world: int) -> None:
    """Every rank's shards of `flat` into `folder`: written into `folder`.partial,
    checked by rank 0 to hold every key whole (every rank's file where rank 0
    sees it: a folder that is not shared fails here, naming the keys), then
    renamed. DCP's save returns on no rank before its coordinator has seen every
    rank's writes finish. Any rank's failure raises on every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    partial = folder.with_name(folder.name + ".partial")

    def prepare():  # a crashed earlier attempt's files (another world size's shards among them) never mix in
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)

    _agree(world, _attempt(prepare) if rank == 0 else None, f"checkpoint {folder.name}: preparing {partial}")
    writer = HuggingFaceStorageWriter(str(partial), fqn_to_index_mapping=_file_index(flat, world),
                                      save_distributed=True)
    with _quiet_single_process():
        dcp.save(flat, storage_writer=writer, no_dist=world == 1)

    def commit():
        bad = _uncovered(partial, {k: t.shape for k, t in flat.items()})
        if bad:
            raise ValueError(f"{partial} does not hold {few_names(bad, 3)}: every trainer rank must write into one "
                             "folder that rank 0 sees (a filesystem all trainer hosts share)")
        shutil.rmtree(folder, ignore_errors=True)
        partial.rename(folder)
        _fsync_dir(folder.parent)

    _agree(world, _attempt(commit) if rank == 0 else None, f"checkpoint {folder.name} not committed")


def _read(folder: Path, flat: dict, world: int) -> None:
    """Fill the tensors of `flat` in place from the DCP folder `folder`.
    ValueError, before any read, naming the keys the folder lacks or holds only
    in part."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    bad = _uncovered(folder, {k: t.shape for k, t in flat.items()})
    if bad:
        raise ValueError(f"{folder} does not hold {few_names(bad, 3)}: not this model's checkpoint, or a rank's file "
                         "is missing")
    with _quiet_single_process():
        dcp.load(flat, storage_reader=HuggingFaceStorageReader(str(folder)), no_dist=world == 1)


class TrainerCheckpoints:
    """One trainer rank's view of a run's checkpoints. Every method is collective
    over the trainer's ranks (called by all of them, in the same order),
    construction included: it checks that every rank sees the folder rank 0
    writes (ValueError on every rank otherwise)."""

    def __init__(self, run_dir: str | Path, rank: int, world: int):
        self.dir, self.rank, self.world = checkpoint_dir(run_dir), rank, world
        self._check_shared()
        info = checkpoint_info(run_dir)
        self.serial = info["serial"] if info else 0

    def _check_shared(self) -> None:
        """Rank 0 writes a random token into the folder; every other rank must read
        it there (a folder of the same path on a host of its own fails)."""
        if self.world == 1:
            return
        import torch.distributed as dist

        token = torch.zeros(16, dtype=torch.uint8)
        mark = self.dir / ".shared"
        if self.rank == 0:
            token = torch.frombuffer(bytearray(os.urandom(16)), dtype=torch.uint8)
            self.dir.mkdir(parents=True, exist_ok=True)
            mark.write_bytes(bytes(token.tolist()))
        dist.broadcast(token, src=0)
        seen = mark.read_bytes() if self.rank and mark.is_file() else None
        failure = None
        if self.rank and seen != bytes(token.tolist()):
            failure = (f"trainer rank {self.rank} does not see in {self.dir} what rank 0 wrote there: the run folder "
                       "must be one filesystem every trainer host shares")
        try:
            _agree(self.world, failure, "the run folder")
        except RuntimeError as exc:
            raise ValueError(str(exc)) from None
        finally:
            if self.rank == 0:
                mark.unlink(missing_ok=True)

    def latest(self) -> dict | None:
        """The last committed checkpoint's record (see the module's docstring)."""
        return checkpoint_info(self.dir.parent)

    def save(self, model, optimizer, *, step: int, data_position: int) -> None:
        """The model's and optimizer's state after `step` steps, committed (the
        record replaced) once every rank's shards are written and checked; the
        previous checkpoint deleted only after. Raises on every rank when any fails."""
        flat = _flat_state(model, optimizer)[0]
        self.serial += 1
        folder = self.dir / f"{self.serial:06d}-step-{step:08d}"
        _write(folder, flat, self.rank, self.world)

        def record():
            _fsync_json(self.dir / "trainer.json", {"format": FORMAT, "step": step, "data_position": data_position,
                                                    "world": self.world, "folder": folder.name,
                                                    "serial": self.serial})
            _fsync_dir(self.dir)
            for old in self.dir.glob("*-step-*"):
                if old != folder:
                    shutil.rmtree(old, ignore_errors=True)

        _agree(self.world, _attempt(record) if self.rank == 0 else None, f"checkpoint {folder.name} not recorded")

    def load(self, model, optimizer) -> dict:
        """Read the last checkpoint into `model` and `optimizer` (any world
        size's); returns its record. ValueError when there is none."""
        info = self.latest()
        if info is None:
            raise ValueError(f"{self.dir} holds no checkpoint")
        flat, model_state, optim_state = _flat_state(model, optimizer)
        _read(self.dir / info["folder"], flat, self.world)  # into the tensors of model_state and optim_state
        set_model_state_dict(model, model_state)
        set_optimizer_state_dict(model, optimizer, optim_state)
        return info

    def has_reference(self) -> bool:
        return (self.dir / "reference").is_dir()

    def save_reference(self, model) -> None:
        """The KL reference's weights, once (the folder's presence commits it)."""
        _write(self.dir / "reference", _flat_state(model)[0], self.rank, self.world)

    def load_reference(self, model) -> None:
        flat, model_state, _ = _flat_state(model)
        _read(self.dir / "reference", flat, self.world)
        set_model_state_dict(model, model_state)


def policy_tensors(run_dir: str | Path, shapes: dict[str, tuple[int, ...]],
                   skip: frozenset[str] = frozenset()) -> Iterator[dict[str, torch.Tensor]]:
    """The policy's weights of `run_dir`'s last checkpoint, whole, in groups of
    about 1 GiB ({name: tensor}, names without `model/`, `skip` left out): one
    process, never the whole model in memory at once. shapes: the model's tensors
    ({name: shape}, `skip` left out), which the checkpoint must hold whole and
    alone: checked before anything is read. ValueError naming the folder without
    a checkpoint, for a tensor it lacks, holds only in part (a rank's file
    missing) or in another shape, and for files it cannot read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    info = checkpoint_info(run_dir)
    if info is None:
        raise ValueError(f"{run_dir} holds no checkpoint: nothing trained to export yet")
    folder = checkpoint_dir(run_dir) / info["folder"]
    saved = checkpoint_metadata(folder)
    names = [k for k in saved if k.startswith("model/") and k[len("model/"):] not in skip]
    extra = sorted(k[len("model/"):] for k in names if k[len("model/"):] not in shapes)
    bad = _uncovered(folder, {f"model/{name}": shape for name, shape in shapes.items()})
    if extra or bad:
        raise ValueError(f"{folder} does not hold this run's model: " + "; ".join(
            ([f"lacks, or holds in part or in another shape, {few_names(bad, 3)} (a rank's file missing, or another "
              "model's checkpoint)"] if bad else [])
            + ([f"holds tensors the model does not: {few_names(extra, 3)}"] if extra else [])))
    group, size = {}, 0
    for key in names:
        meta = saved[key]
        group[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
        size += group[key].nbytes
        if size >= _GROUP_BYTES or key == names[-1]:
            try:
                with _quiet_single_process():
                    dcp.load(group, storage_reader=HuggingFaceStorageReader(str(folder)), no_dist=True)
            except Exception as exc:  # a file truncated or replaced after its metadata was read
                raise _unreadable(folder, exc) from None
            yield {k[len("model/"):]: v for k, v in group.items()}
            group, size = {}, 0
