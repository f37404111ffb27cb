"""A run's inputs given as Python objects, `Controller(config, out, model=...,
tokenizer=..., dataset=...)`: written into the run folder, `out/inputs/`, before
any executor starts and before anything is checked, and the config pointed at
them, so that the executors (other processes, other hosts under torchrun) read
files as they do for `--model` and `--dataset`, never a pickle; a resumed run
reads them from there (`TrainConfig.load(out / "config.json")`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..models.checkpoint import save_model_folder
from .config import TrainConfig

INPUTS = "inputs"


def write_inputs(out: Path, config: TrainConfig, *, model=None, tokenizer=None, dataset=None) -> TrainConfig:
    """`config` with `model` (a transformers causal LM, written with `tokenizer`
    as a model folder: config.json, safetensors, the tokenizer's files) and
    `dataset` (any iterable of dicts, a datasets.Dataset among them, written as
    JSONL, one row a line) pointing at what was written under out/inputs/.
    ValueError naming the argument, before a byte is written, for: a model
    without its tokenizer or a tokenizer without a model, a model or tokenizer
    that is not transformers' (no save_pretrained), a field of `config` giving
    the same input; ValueError naming the row for a row that is not a dict of
    JSON values (nothing kept then). Returns `config` itself when none is given."""
    if model is None and tokenizer is None and dataset is None:
        return config
    if (model is None) != (tokenizer is None):
        given, missing = ("model", "tokenizer") if tokenizer is None else ("tokenizer", "model")
        raise ValueError(f"{given}= needs {missing}= too: prompts are encoded with the model's own tokenizer")
    for name, obj in (("model", model), ("tokenizer", tokenizer)):
        if obj is not None and not callable(getattr(obj, "save_pretrained", None)):
            raise ValueError(f"{name}= must be a transformers {'model' if name == 'model' else 'tokenizer'} (it has no "
                             f"save_pretrained), got {type(obj).__name__}")
    for name, obj in (("model", model), ("dataset", dataset)):
        if obj is not None and getattr(config.run, name) is not None:
            raise ValueError(f"{name}= and TrainConfig.run.{name} ({getattr(config.run, name)!r}) both give the "
                             f"run's {name}: give one")
    lines = None if dataset is None else _jsonl(dataset)
    folder = Path(out) / INPUTS
    folder.mkdir(parents=True, exist_ok=True)
    changes = {}
    try:
        if lines is not None:
            path = folder / "dataset.jsonl"
            path.write_text(lines)
            changes["dataset"] = str(path.resolve())
        if model is not None:
            changes["model"] = str(save_model_folder(model, tokenizer, folder / "model").resolve())
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return config.replace(**changes)


def _jsonl(dataset) -> str:
    if isinstance(dataset, (str, bytes, dict)) or not hasattr(dataset, "__iter__"):
        raise ValueError(f"dataset= must be an iterable of dicts (a datasets.Dataset, a list), got "
                         f"{type(dataset).__name__}; a JSONL file goes in TrainConfig(dataset=...)")
    rows = []
    for index, row in enumerate(dataset):
        if not isinstance(row, dict):
            raise ValueError(f"dataset= row {index}: a {type(row).__name__}, not a dict")
        try:
            rows.append(json.dumps(row, allow_nan=False) + "\n")
        except (TypeError, ValueError) as exc:
            raise ValueError(f"dataset= row {index}: not JSON values ({exc})") from None
    if not rows:
        raise ValueError("dataset= has no rows")
    return "".join(rows)
