"""Models the pipeline runs: the Llama family's description (llama_family.py:
which configs, their dimensions and parameter names), the generator side's
inference Llama (llama_generator.py), checkpoints and the trainer's sharded
build. The generator's names load on first use, so the layout presets can read
the family (sync/presets.py -> llama_family.py) while the generator builds on
those presets (llama_generator.py -> sync/presets.py) with no import circle."""

import importlib

__all__ = ["KVCache", "LlamaGenerator", "Rollout", "sample_tokens"]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(".llama_generator", __name__), name)
