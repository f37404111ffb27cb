"""Pretrained models from disk: a Hugging Face model folder (config.json and
safetensors weights) or a single GGUF file, of any causal LM transformers builds
(the trainer's model; which generator runs it is checked by
`check_generator_config`); and the way back out, a folder that `transformers`
and vLLM load.

Everything here checks before it loads: a path that is not a model, weights
only as a pickle, a model transformers has no causal LM for, a family or RoPE
variant the chosen generator does not run, each raise a ValueError naming the
path and what is wrong, before any process starts.
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path

import torch

from ..spelling import option
from .llama_family import LLAMA_FAMILY, check_llama_family
from .llama_generator import rope_inv_freq


def _family(config) -> str:
    archs = ", ".join(getattr(config, "architectures", None) or []) or "no architectures listed"
    return f"model_type {getattr(config, 'model_type', None)!r} ({archs})"


def check_causal_lm(config, where: str) -> None:
    """ValueError unless transformers builds a causal LM of `config` (the trainer's
    model, through AutoModelForCausalLM); `where` names it in the message."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"{where}: {_family(config)} is not a causal language model transformers builds "
                         "(AutoModelForCausalLM)")


def check_generator_config(config, generator: str, where: str) -> None:
    """ValueError unless `generator` runs `config`: vLLM ("vllm") any causal LM
    (its own loaders place the weights); ours ("llama") the Llama family
    (LLAMA_FAMILY, no experts or q/k norms) with a RoPE variant it computes."""
    check_causal_lm(config, where)
    if generator != "llama":
        return
    try:
        check_llama_family(config)
    except ValueError:
        raise ValueError(f"{where}: {_family(config)}: the built-in generator runs the Llama family "
                         f"({', '.join(LLAMA_FAMILY)}) only; run this model with {option('generator', 'vllm')}") from None
    try:
        rope_inv_freq(config, 2)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def context_length(config) -> int:
    """Tokens a sequence may hold: max_position_embeddings, or a sliding attention
    window if the model uses a smaller one (our generator attends to every token)."""
    limit = int(config.max_position_embeddings)
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True):
        limit = min(limit, int(window))
    return limit


@contextlib.contextmanager
def _no_progress_bars():
    """transformers' progress bars off (loading, de-quantizing, writing shards: a
    run's log is not a terminal), as they were after."""
    from transformers.utils import logging

    was_on = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            logging.enable_progress_bar()


class ModelSource:
    """A pretrained model on disk: `path` is a model folder or a `.gguf` file.
    Construction checks the path (not the weights' contents); `config()` reads the
    config, `tokenizer()` the tokenizer, `load_model()` the weights."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        self._config = None
        if not self.path.exists():
            raise ValueError(f"{option('model', str(self.path))}: no such file or folder")
        if self.path.is_file():
            if self.path.suffix != ".gguf":
                raise ValueError(f"{option('model', str(self.path))}: a file must be a .gguf model; otherwise give the folder "
                                 "that holds config.json and the *.safetensors weights")
            try:
                import gguf  # noqa: F401
            except ImportError:
                raise ValueError(f"{option('model', str(self.path))}: reading GGUF needs the gguf package: "
                                 "pip install 'llamarl-core[gguf]'") from None
            self.folder, self.gguf_file = self.path.parent, self.path.name
            return
        self.folder, self.gguf_file = self.path, None
        if not (self.folder / "config.json").is_file():
            raise ValueError(f"{option('model', str(self.path))}: no config.json (a Hugging Face model folder holds config.json "
                             "and *.safetensors weights)")
        if not any(self.folder.glob("*.safetensors")):
            pickles = sorted(p.name for p in self.folder.glob("*.bin"))
            found = f" (found {', '.join(pickles)}: pickle checkpoints are not loaded)" if pickles else ""
            raise ValueError(f"{option('model', str(self.path))}: no *.safetensors weights{found}")

    def __repr__(self) -> str:
        return f"ModelSource({str(self.path)!r})"

    def _kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}

    def config(self):
        """The transformers config, checked (architecture, RoPE type); a GGUF file's
        quantization marker removed, since the weights are dequantized on loading.
        Read once (from GGUF, reading it takes seconds)."""
        import transformers

        if self._config is not None:
            return self._config
        try:
            config = transformers.AutoConfig.from_pretrained(self.folder, **self._kwargs())
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"{option('model', str(self.path))}: cannot read its config: {exc}") from None
        check_causal_lm(config, f"{option('model', str(self.path))}")
        if getattr(config, "quantization_config", None) is not None and self.gguf_file:
            del config.quantization_config
        self._config = config
        return config

    def tokenizer(self):
        import transformers

        try:
            with _no_progress_bars():
                return transformers.AutoTokenizer.from_pretrained(self.folder, **self._kwargs())
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{option('model', str(self.path))}: cannot load its tokenizer: {exc}") from None

    def generation_config(self):
        """The model's transformers GenerationConfig (eos ids, sampling defaults), or
        None where it ships none."""
        import transformers

        try:
            return transformers.GenerationConfig.from_pretrained(self.folder, **self._kwargs())
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def load_model(self, dtype: torch.dtype = torch.float32):
        """The causal LM with its pretrained weights, as a plain transformers model
        in `dtype`. From GGUF, transformers dequantizes the weights but marks the
        model as quantized (save_pretrained then refuses it): its state goes into a
        plain model of the same class."""
        import transformers

        config = self.config()
        with _no_progress_bars():
            model = transformers.AutoModelForCausalLM.from_pretrained(self.folder, config=config, dtype=dtype,
                                                                      **self._kwargs())
        if self.gguf_file:
            plain = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
            plain.load_state_dict(model.state_dict())
            model = plain
        return model


def _replace_folder(out: str | Path, write) -> Path:
    """Run `write(tmp)` on a fresh folder beside `out`, then rename it to `out`,
    so `out` is either whole or absent. An existing `out` is replaced only if it
    is a model folder (it holds a config.json and nothing but files): anything
    else raises ValueError before a byte is written."""
    import shutil
    import tempfile

    out = Path(out).resolve()
    if out.exists() and not (out.is_dir() and (out / "config.json").is_file()
                             and all(p.is_file() for p in out.iterdir())):
        raise ValueError(f"{out} exists and is not a model folder: give a new folder (nothing was written)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; a model folder is not
    try:
        write(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def save_model_folder(model, tokenizer, out: str | Path) -> Path:
    """`model` (a transformers causal LM) and `tokenizer` (a transformers
    tokenizer) as a model folder: config.json, model.safetensors, the tokenizer's
    files; whole or absent, an existing `out` replaced only if it is a model
    folder (ValueError otherwise, before a byte is written)."""
    def write(tmp: Path) -> None:
        with _no_progress_bars():
            model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    return _replace_folder(out, write)


def stream_model_folder(model_config, tensor_groups, tokenizer, out: str | Path, generation_config=None) -> Path:
    """A model folder written one group of tensors at a time: `tensor_groups`
    yields {checkpoint name: tensor} dicts, each written to its own safetensors
    file as it comes (`model.safetensors` when there is one, else
    `model-0000i-of-0000N.safetensors` and the index transformers and vLLM
    read), then `model_config` (its dtype the tensors'), `generation_config`
    (transformers' default for the config when None) and `tokenizer`'s files.
    Whole or absent, as `save_model_folder`."""
    import transformers
    from safetensors.torch import save_file

    def write(tmp: Path) -> None:
        files, weight_map, total, dtype = [], {}, 0, None
        for i, group in enumerate(tensor_groups):
            name = f"part-{i:05d}.safetensors"
            save_file({k: v.contiguous() for k, v in group.items()}, tmp / name, metadata={"format": "pt"})
            files.append((name, list(group)))
            total += sum(v.nbytes for v in group.values())
            dtype = dtype or next(iter(group.values())).dtype
        if not files:
            raise ValueError("no tensors to write")
        for i, (name, keys) in enumerate(files):
            final = "model.safetensors" if len(files) == 1 else f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            (tmp / name).rename(tmp / final)
            weight_map.update(dict.fromkeys(keys, final))
        if len(files) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        config = copy.deepcopy(model_config)
        config.dtype = dtype
        config.save_pretrained(tmp)
        generation = generation_config or transformers.GenerationConfig.from_model_config(config)
        generation.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return _replace_folder(out, write)


def main(argv=None) -> int:
    """`python -m llamarl_core.models.checkpoint SOURCE OUT`: a model (folder or
    .gguf file) re-written as a plain float32 model folder."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m llamarl_core.models.checkpoint", description=main.__doc__)
    parser.add_argument("source", help="a model folder or .gguf file")
    parser.add_argument("out", help="the model folder to write")
    args = parser.parse_args(argv)
    try:
        source = ModelSource(args.source)
        out = save_model_folder(source.load_model(torch.float32), source.tokenizer(), args.out)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    print(f"wrote {out}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
