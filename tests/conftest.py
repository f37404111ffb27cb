import os
import sys

import pytest
import torch

# Without a GPU the Triton kernels run on CPU tensors in Triton's interpreter. The
# variable must be set before any @triton.jit decorator runs (set later, launches
# fail with "0 active drivers").
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        # The Triton cases run on CUDA tensors there: `pytest -m gpu` (llamarl check gpu) takes them too.
        for item in items:
            if "triton-cuda" in item.name:
                item.add_marker(pytest.mark.gpu)
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
