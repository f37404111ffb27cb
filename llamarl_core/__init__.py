"""llamarl_core: primitives for asynchronous, distributed RL of large language models.

- `llamarl_core.sync`: DDMA weight sync (layouts, planner, sender / receiver, FP8 destinations).
- `llamarl_core.ops`: FP8 weight quantization and the AIPO loss (Triton kernels, CPU paths, references).
- `llamarl_core.models`: the generator's inference Llama in vLLM's fused tensor-parallel layout.

Importing needs no GPU, driver, NVML or built extension; what is missing raises when used.
"""

__version__ = "0.1.0"
