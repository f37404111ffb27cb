#!/usr/bin/env bash
# Create a fresh virtual environment at $1 and install llamarl-core from this
# repository into it, with the CPU build of torch pinned (a plain `torch`
# requirement would pull a several-GB CUDA build).
set -euo pipefail
venv=${1:?usage: scripts/install.sh VENV_DIR [extras]}
extras=${2:-test}
root=$(cd "$(dirname "$0")/.." && pwd)
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet torch==2.13.0
"$venv/bin/pip" install --quiet "$root[$extras]"
# From / so that `-c` cannot pick up a source tree in the working directory
# (a clean checkout has no built _C in it).
(cd / && "$venv/bin/python" -c "import llamarl_core._C as c; print('llamarl_core._C built:', c.build_summary)")
