#!/usr/bin/env bash
# The producer venvs of tools/dev/make_quant_fixtures.py, under DIR (default .scratch/quant-venvs).
# CPU only; torch 2.13.0 (CPU wheel). Measured on a 2-core machine: about 7 minutes and 7 GB in all.
#   main    nvidia-modelopt 0.47.0 (transformers 5.24.0)
#   llmc    llmcompressor 0.14.0.1 (pins transformers <= 5.17 and compressed-tensors 0.19.0)
#   gptq    gptqmodel 7.6.0 (7.7.0 needs torch >= 2.14.1, CUDA wheels only), optimum 2.3.0
#   legacy  autoawq 0.2.9 (auto-gptq 0.7.1 does not import with transformers 5, so native GPTQ comes from gptqmodel)
set -euo pipefail
DIR=${1:-.scratch/quant-venvs}
mkdir -p "$DIR"
mk() { [ -x "$DIR/$1/bin/python" ] || python3 -m venv "$DIR/$1"; "$DIR/$1/bin/pip" install -q torch==2.13.0; }
mk main
"$DIR/main/bin/pip" install -q transformers==5.24.0 accelerate safetensors nvidia-modelopt==0.47.0
mk llmc
"$DIR/llmc/bin/pip" install -q llmcompressor==0.14.0.1
mk gptq
"$DIR/gptq/bin/pip" install -q transformers==5.24.0 gptqmodel==7.6.0 optimum==2.3.0
mk legacy
"$DIR/legacy/bin/pip" install -q transformers==5.24.0 accelerate
BUILD_CUDA_EXT=0 "$DIR/legacy/bin/pip" install -q autoawq==0.2.9
