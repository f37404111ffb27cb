"""What every Triton launcher needs to know: interpreter mode and its lock."""

from __future__ import annotations

import contextlib
import os
import threading

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
