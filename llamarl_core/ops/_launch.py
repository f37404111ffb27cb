"""What every Triton launcher needs: interpreter mode and its lock, block sizes,
and one description of a launch that both runs it and compiles it ahead of time."""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass

import torch


def use_interpreter() -> bool:
    """TRITON_INTERPRET=1: Triton kernels run on CPU tensors in Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Triton's interpreter patches module-level state while it runs a kernel: two
# threads interpreting at once fail ("Did you forget to add @triton.jit?").
_INTERPRETER_LOCK = threading.Lock()


def serialized(device: torch.device):
    """A lock around interpreted launches; nothing for real GPU launches."""
    return _INTERPRETER_LOCK if device.type == "cpu" else contextlib.nullcontext()


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1): Triton block sizes are powers of two."""
    return 1 << max(0, (x - 1).bit_length())


@dataclass(frozen=True)
class KernelLaunch:
    """One Triton launch, fully described. Launchers build it and `launch()` it;
    llamarl_core.ops.kernel_check compiles the same description for a GPU target
    without a GPU, so the tests compile the launchers' own variants (on sizes that
    are multiples of 16 and on sizes that are not; specializations the JIT makes
    for other argument values, such as a size of 1, are compiled at first launch)."""

    kernel: object  # a @triton.jit function
    grid: tuple[int, ...]
    args: dict  # runtime arguments by parameter name: tensors, ints, floats
    constexprs: dict
    num_warps: int

    def launch(self, device: torch.device) -> None:
        with serialized(device):
            self.kernel[self.grid](**self.args, **self.constexprs, num_warps=self.num_warps)
