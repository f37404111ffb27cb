"""The trainer's checkpoints: torch.distributed.checkpoint (DCP) folders in
safetensors, each trainer rank writing its own shards and reading back its
own (at the same or another world size: DCP reshards), no rank ever holding
the whole model or optimizer state.

Layout of a run folder's `checkpoint/`:
- `trainer.json`: the commit record, replaced atomically once every rank's
  shards are on disk: {"format", "step", "data_position", "world", "folder",
  "serial"}. A crash before it is replaced leaves the previous checkpoint whole.
- `<serial>-step-<step>/`: the committed DCP folder, one
  `shard-<rank>-model-00001-of-00001.safetensors` a rank, holding `model/<fqn>`
  (the float32 master weights) and `optimizer/<fqn>/<stat>` (AdamW's moments
  and step). The optimizer's hyper-parameters are the run's config, not saved.
- `reference/`: the KL reference's weights (`model/<fqn>`, the run's compute
  dtype), written once when RL starts.
Nothing in it is a pickle: DCP's safetensors reader builds its metadata from
the files' JSON headers, and the commit record is JSON.

The folder must be one filesystem every trainer rank sees (every rank writes
its shards there)."""

from __future__ import annotations

import contextlib
import json
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

from ..models.sharded import tied_parameters

FORMAT = "llamarl-dcp-safetensors/1"
_GROUP_BYTES = 1 << 30  # export reads and writes the policy this many bytes at a time


def checkpoint_dir(run_dir: str | Path) -> Path:
    """Where a run's trainer keeps its checkpoints."""
    return Path(run_dir) / "checkpoint"


def checkpoint_info(run_dir: str | Path) -> dict | None:
    """The commit record of `run_dir`'s last checkpoint, None before the first.
    ValueError for a checkpoint of another format (an earlier llamarl's
    `trainer.pt`, one torch.save file) or a record whose folder is gone."""
    folder = checkpoint_dir(run_dir)
    record = folder / "trainer.json"
    if not record.is_file():
        if (folder / "trainer.pt").is_file():
            raise ValueError(f"{folder / 'trainer.pt'} is an earlier llamarl's checkpoint (one torch.save file); this "
                             "version writes and reads torch.distributed.checkpoint folders: start the run anew")
        return None
    info = json.loads(record.read_text())
    if info.get("format") != FORMAT:
        raise ValueError(f"{record}: format {info.get('format')!r}, this version reads {FORMAT!r}")
    if not (folder / info["folder"]).is_dir():
        raise ValueError(f"{record} names {info['folder']}, which is not in {folder}")
    return info


def _flat_state(model, optimizer=None) -> tuple[dict[str, torch.Tensor], dict, dict | None]:
    """The model's (and optimizer's) sharded state as one flat {key: tensor} of
    the live tensors (DCP reads into and writes from them; a tied parameter once,
    under its first name), and the model's and optimizer's state dicts those
    tensors belong to."""
    model_state = get_model_state_dict(model)
    second = {name for names in tied_parameters(model) for name in names[1:]}
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


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def _write(folder: Path, flat: dict, rank: int, world: int) -> None:
    """Every rank's shards of `flat` into `folder`, written as `folder`.partial
    and renamed by rank 0 once DCP's coordinator has seen every rank's writes
    finish (DCP's save returns on no rank before that)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    partial = folder.with_name(folder.name + ".partial")
    if rank == 0:  # a crashed earlier attempt's files (another world size's shards among them) never mix in
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    _barrier(world)
    with _quiet_single_process():
        dcp.save(flat, storage_writer=HuggingFaceStorageWriter(str(partial), save_distributed=True),
                 no_dist=world == 1)
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
        partial.rename(folder)


def _read(folder: Path, flat: dict, world: int) -> None:
    """Fill the tensors of `flat` in place from the DCP folder `folder`; KeyError
    names a key the folder lacks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    reader = HuggingFaceStorageReader(str(folder))
    saved = reader.read_metadata().state_dict_metadata
    missing = [k for k in flat if k not in saved]
    if missing:
        raise KeyError(f"{folder} lacks {missing[:4]}{' ...' if len(missing) > 4 else ''}: not this model's "
                       "checkpoint")
    with _quiet_single_process():
        dcp.load(flat, storage_reader=HuggingFaceStorageReader(str(folder)), no_dist=world == 1)


class TrainerCheckpoints:
    """One trainer rank's view of a run's checkpoints. Every method is collective
    over the trainer's ranks (called by all of them, in the same order)."""

    def __init__(self, run_dir: str | Path, rank: int, world: int):
        self.dir, self.rank, self.world = checkpoint_dir(run_dir), rank, world
        info = checkpoint_info(run_dir)
        self.serial = info["serial"] if info else 0

    def latest(self) -> dict | None:
        """The last committed checkpoint's record (see the module's docstring)."""
        return checkpoint_info(self.dir.parent)

    def save(self, model, optimizer, *, step: int, data_position: int) -> None:
        """The model's and optimizer's state after `step` steps, committed once
        every rank's shards are written; older checkpoints deleted after."""
        flat = _flat_state(model, optimizer)[0]
        self.serial += 1
        folder = self.dir / f"{self.serial:06d}-step-{step:08d}"
        _write(folder, flat, self.rank, self.world)
        if self.rank == 0:
            _fsync_json(self.dir / "trainer.json", {"format": FORMAT, "step": step, "data_position": data_position,
                                                    "world": self.world, "folder": folder.name,
                                                    "serial": self.serial})
            for old in self.dir.glob("*-step-*"):
                if old != folder:
                    shutil.rmtree(old, ignore_errors=True)
        _barrier(self.world)  # the record is on disk before any rank goes on

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
        _barrier(self.world)

    def load_reference(self, model) -> None:
        flat, model_state, _ = _flat_state(model)
        _read(self.dir / "reference", flat, self.world)
        set_model_state_dict(model, model_state)


def policy_tensors(run_dir: str | Path, skip: frozenset[str] = frozenset()) -> Iterator[dict[str, torch.Tensor]]:
    """The policy's weights of `run_dir`'s last checkpoint, whole, in groups of
    about 1 GiB ({name: tensor}, names without `model/`, `skip` left out): one
    process, never the whole model in memory at once. ValueError without a
    checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    info = checkpoint_info(run_dir)
    if info is None:
        raise ValueError(f"{run_dir} holds no checkpoint: nothing trained to export yet")
    folder = str(checkpoint_dir(run_dir) / info["folder"])
    saved = HuggingFaceStorageReader(folder).read_metadata().state_dict_metadata
    names = [k for k in saved if k.startswith("model/") and k[len("model/"):] not in skip]
    group, size = {}, 0
    for key in names:
        meta = saved[key]
        group[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
        size += group[key].nbytes
        if size >= _GROUP_BYTES or key == names[-1]:
            with _quiet_single_process():
                dcp.load(group, storage_reader=HuggingFaceStorageReader(folder), no_dist=True)
            yield {k[len("model/"):]: v for k, v in group.items()}
            group, size = {}, 0
