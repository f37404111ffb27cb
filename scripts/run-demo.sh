#!/usr/bin/env bash
# The main job: a fresh virtual environment, install, then `llamarl train` on its
# embedded default (a small Llama learns to reverse strings by asynchronous RL:
# generator, trainer and reward executors in their own processes, weights synced
# by the DDMA engine after every step). Extra arguments go to `llamarl train`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${LLAMARL_VENV:-$root/.venv}
bash "$root/scripts/install.sh" "$venv" train
cd "$root"
"$venv/bin/llamarl" train "$@"
