"""A run's policy as a model folder (`llamarl export RUN_DIR OUT`, and `model/` at
the end of every run): config.json, model.safetensors and the tokenizer, which
`transformers.AutoModelForCausalLM.from_pretrained` and vLLM load. The weights
are the trainer's float32 master weights from the run's last checkpoint, read
with `torch.load(weights_only=True)`."""

from __future__ import annotations

from pathlib import Path

import torch

from ..models.checkpoint import save_model_folder
from .config import TrainConfig
from .data import ModelTokenizer, model_and_tokenizer
from .task import load_task


def checkpoint_path(run_dir: str | Path) -> Path:
    """Where a run's trainer keeps its checkpoint."""
    return Path(run_dir) / "checkpoint" / "trainer.pt"


def export_policy(checkpoint: str | Path, model_config, tokenizer, out: str | Path, source=None) -> Path:
    """The model weights of the trainer checkpoint `checkpoint`, with `model_config`
    (a transformers config) and `tokenizer` (the run's: a ModelTokenizer or a
    CharTokenizer), written to the model folder `out`, with the generation config
    of `source` (the ModelSource it started from) where it has one; returns `out`."""
    import transformers

    saved = torch.load(checkpoint, weights_only=True, mmap=True)
    model = transformers.AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)
    model.load_state_dict(saved["model"])
    generation = source.generation_config() if source is not None else None
    if generation is not None:
        model.generation_config = generation
    hf_tokenizer = tokenizer.hf if isinstance(tokenizer, ModelTokenizer) else tokenizer.to_transformers()
    return save_model_folder(model, hf_tokenizer, out)


def export_run(run_dir: str | Path, out: str | Path) -> Path:
    """Write the policy of the run in `run_dir` (its config.json and last
    checkpoint) to the folder `out`; returns `out`. ValueError if `run_dir` holds
    no run or no checkpoint."""
    run_dir = Path(run_dir)
    config_path, checkpoint = run_dir / "config.json", checkpoint_path(run_dir)
    if Path(out).resolve() in (run_dir.resolve(), *run_dir.resolve().parents):
        raise ValueError(f"{out} is the run folder {run_dir} or holds it: give a folder of its own")
    if not config_path.is_file():
        raise ValueError(f"{run_dir} holds no run (no config.json)")
    if not checkpoint.is_file():
        raise ValueError(f"{run_dir} holds no checkpoint ({checkpoint}): nothing trained to export yet")
    config = TrainConfig.load(config_path)
    source, model_config, tokenizer = model_and_tokenizer(config, None if config.dataset else load_task(config.task))
    return export_policy(checkpoint, model_config, tokenizer, out, source)
