#!/usr/bin/env bash
# The main job: a fresh virtual environment, install, then the weight-sync
# benchmark on its default model (about 1 GiB in bf16, FSDP 2 -> TP 2).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${LLAMARL_VENV:-$root/.venv}
bash "$root/scripts/install.sh" "$venv" test
"$venv/bin/llamarl" bench sync "$@"
