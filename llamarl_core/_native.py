"""Access to the native module `llamarl_core._C`, imported on first use.

Importing llamarl_core never needs the built extension, a GPU, a driver or NVML:
a missing piece raises an actionable error when it is first called.
"""

from __future__ import annotations

import functools
from types import ModuleType


@functools.lru_cache(maxsize=None)
def native() -> ModuleType:
    try:
        from llamarl_core import _C
    except ImportError as exc:
        raise ImportError(
            "llamarl_core._C (the native copy engine) is not built: reinstall with "
            "`pip install -e .` from the repository root (needs cmake and a C++17 compiler)"
        ) from exc
    return _C


def native_cuda() -> ModuleType:
    """The native module, checked to have its CUDA backend and a visible device."""
    mod = native()
    if not mod.built_with_cuda:
        raise RuntimeError(
            "llamarl_core._C was built without its CUDA backend (nvcc not found or "
            "LLAMARL_SKIP_CUDA=1); rebuild on a machine with the CUDA toolkit"
        )
    if mod.cuda_device_count() == 0:
        raise RuntimeError("no CUDA device: the driver is missing or no GPU is visible to this process")
    return mod
