"""What the delta benches send: a fraction of the trainer's elements changed
(`perturb`, `llamarl bench sync --delta`), or the consecutive weight versions of a
real `llamarl train` run (`llamarl bench sync --hosts --delta-versions`), saved by
a step hook that saves the policy as the generator holds it (bf16, torch's round-to-nearest-even cast of the float32 masters, as the
sync casts them) before the first step and after every step.

    LLAMARL_SAVE_VERSIONS=/tmp/versions-lr1e-6 llamarl train --model SmolLM2-135M-Instruct \\
        --dtype bfloat16 --lr 1e-6 --steps 6 --step-hook llamarl_core.bench.versions:save_versions

writes into that folder `config.json` (the model's) and `version-0000.safetensors`,
`version-0001.safetensors`, ...: each parameter under its named_parameters() name
(a tied one once), whole. On several trainer ranks every rank gathers each
parameter (DTensor.full_tensor) and rank 0 writes."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from llamarl_core.sync.reference import reference_fsdp_shards

ENV = "LLAMARL_SAVE_VERSIONS"
DTYPE = torch.bfloat16


def _save(model: torch.nn.Module, folder: Path, index: int, rank: int) -> None:
    tensors = {}
    for name, param in model.named_parameters():  # a tied parameter is yielded once
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        if rank == 0:
            tensors[name] = full.detach().to(DTYPE).cpu().contiguous()
    if rank == 0:
        partial = folder / f"version-{index:04d}.safetensors.partial"
        save_file(tensors, str(partial))
        partial.rename(folder / f"version-{index:04d}.safetensors")


def save_versions(context, step):
    """A step hook (TrainConfig.step_hook): the weights before this step, if it is
    the run's first here, and after it, into $LLAMARL_SAVE_VERSIONS."""
    target = os.environ.get(ENV)
    if not target:
        raise ValueError(f"save_versions: set {ENV} to the folder the versions go to")
    folder = Path(target)
    if context.rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        if not (folder / "config.json").exists():
            config = getattr(context.model, "config", None)
            if config is None:
                raise ValueError("save_versions: the policy has no Hugging Face config (run it with --model)")
            (folder / "config.json").write_text(config.to_json_string())
    if context.step == 0:
        _save(context.model, folder, 0, context.rank)
    step()
    _save(context.model, folder, context.step + 1, context.rank)
    return None


def load_versions(folder: str | Path) -> tuple[dict, list[Path]]:
    """(the model's config as a dict, the version files in order) of a folder
    save_versions wrote; ValueError naming what is missing."""
    folder = Path(folder)
    config = folder / "config.json"
    files = sorted(folder.glob("version-*.safetensors"))
    if not config.is_file() or not files:
        raise ValueError(f"{folder}: no config.json and version-*.safetensors (written by {__name__}.save_versions)")
    numbers = [int(f.name[len("version-"):-len(".safetensors")]) for f in files]
    if numbers != list(range(len(files))):
        raise ValueError(f"{folder}: versions {numbers}, not 0, 1, 2, ... in a row")
    return json.loads(config.read_text()), files


def read_version(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def check_version_folders(folders: list[str], rounds: int) -> None:
    """ValueError unless every folder holds save_versions' files, at least `rounds`
    versions each, all of one model."""
    configs = []
    for folder in folders:
        config, files = load_versions(folder)
        if len(files) < rounds:
            raise ValueError(f"{folder} holds {len(files)} versions, fewer than the {rounds} rounds "
                             "(--warmup + --repeats)")
        configs.append(config)
    if any(c != configs[0] for c in configs):
        raise ValueError("the folders hold different models (their config.json differ)")


def version_shards(files, index: int, fsdp: int, rank: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Trainer rank `rank`'s FSDP shards of version `index` (a save_versions file)."""
    return reference_fsdp_shards(read_version(files[index]), fsdp, dtype)[rank]


def version_loader(files, shards: dict[str, torch.Tensor], fsdp: int, rank: int, dtype: torch.dtype):
    """prepare(i) of a --delta-versions sender: version i into its registered tensors, in place."""
    def prepare(i: int) -> None:
        if i:
            for name, piece in version_shards(files, i, fsdp, rank, dtype).items():
                shards[name].copy_(piece)
    return prepare


def fraction_arg(text: str) -> float:
    """An argparse type: a fraction of the elements, 0 to 1."""
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"a fraction of the elements, from 0 to 1, got {text}")
    return value


def perturb(shards: dict[str, torch.Tensor], fraction: float, seed: int) -> None:
    """Add 1 to `fraction` of each shard's elements, drawn at random (each at most
    once): every one drawn changes in bf16 (the shards are normal draws)."""
    gen = torch.Generator().manual_seed(seed)
    for t in shards.values():
        flat = t.view(-1)
        count = round(fraction * flat.numel())
        if count:
            flat[torch.randperm(flat.numel(), generator=gen)[:count].to(flat.device)] += 1.0
