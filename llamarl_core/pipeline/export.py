"""A run's policy as a model folder (`llamarl export RUN_DIR OUT`, and `model/` at
the end of every run): config.json, safetensors weights and the tokenizer, which
`transformers.AutoModelForCausalLM.from_pretrained` and vLLM load. The weights
are the trainer's float32 master weights (and persistent buffers) from the
run's last checkpoint (a DCP folder of safetensors, checkpoints.py), streamed
about 1 GiB at a time: no process holds the whole model. A family whose
checkpoints transformers converts on load (a MoE whose experts it fuses) is
written under its checkpoints' own names, each a slice of a parameter:
transformers' own reverse conversion, run on view probes (sync/live.py
checkpoint_views), says which slice. One whose conversion computes rather than
slices is written by transformers' save_pretrained, from the whole model in memory."""

from __future__ import annotations

from pathlib import Path

import torch

from ..models.checkpoint import save_model_folder, stream_model_folder
from ..models.sharded import copy_from_full, empty_model, tied_aliases
from ..sync.live import checkpoint_views
from .checkpoints import checkpoint_dir, checkpoint_info, policy_tensors
from .config import TrainConfig
from .data import ModelTokenizer, model_and_tokenizer
from .task import load_task


def export_policy(run_dir: str | Path, model_config, tokenizer, out: str | Path, source=None) -> Path:
    """The policy of the last checkpoint of the run in `run_dir`, with
    `model_config` (a transformers config) and `tokenizer` (the run's: a
    ModelTokenizer or a CharTokenizer), written to the model folder `out`, with
    the generation config of `source` (the ModelSource it started from) where it
    has one; returns `out`."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)
    generation = source.generation_config() if source is not None else None
    hf_tokenizer = tokenizer.hf if isinstance(tokenizer, ModelTokenizer) else tokenizer.to_transformers()
    # What the checkpoint must hold: the state's tensors, a tied parameter once (under its first name).
    tied = tied_aliases(model)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items() if name not in tied}
    try:
        views = checkpoint_views(model, buffers=True)
    except ValueError:  # a conversion that computes rather than slices: transformers' save_pretrained undoes it
        model = empty_model(model_config, dtype=torch.float32, device="cpu")
        copy_from_full(model, {name: t for group in policy_tensors(run_dir, shapes) for name, t in group.items()})
        if generation is not None:
            model.generation_config = generation
        return save_model_folder(model, hf_tokenizer, out)
    # A tied parameter's second name (lm_head.weight) is not written, as transformers does.
    groups = _checkpoint_tensors(policy_tensors(run_dir, shapes, skip=tied), views)
    return stream_model_folder(model_config, groups, hf_tokenizer, out, generation)


def _checkpoint_tensors(groups, views):
    """Each group of the policy's tensors ({name: tensor}) as the checkpoint tensors
    they hold ({checkpoint name: the tensor's slice}, views: checkpoint_views)."""
    for group in groups:
        unknown = [name for name in group if name not in views]
        if unknown:
            raise ValueError(f"the checkpoint holds tensors the model does not: {unknown[:4]}")
        yield {ckpt: tensor[tuple(slice(o, o + e) for o, e in zip(*box))].reshape(shape)
               for name, tensor in group.items() for ckpt, shape, box in views[name]}


def export_run(run_dir: str | Path, out: str | Path) -> Path:
    """Write the policy of the run in `run_dir` (its config.json and last
    checkpoint) to the folder `out`; returns `out`. ValueError if `run_dir` holds
    no run or no checkpoint."""
    run_dir = Path(run_dir)
    config_path = run_dir / "config.json"
    if Path(out).resolve() in (run_dir.resolve(), *run_dir.resolve().parents):
        raise ValueError(f"{out} is the run folder {run_dir} or holds it: give a folder of its own")
    if not config_path.is_file():
        raise ValueError(f"{run_dir} holds no run (no config.json)")
    if checkpoint_info(run_dir) is None:
        raise ValueError(f"{run_dir} holds no checkpoint (in {checkpoint_dir(run_dir)}): nothing trained to export "
                         "yet")
    config = TrainConfig.load(config_path)
    task = None if config.run.dataset else load_task(config.run.task)
    source, model_config, tokenizer = model_and_tokenizer(config, task)
    return export_policy(run_dir, model_config, tokenizer, out, source)
