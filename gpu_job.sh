#!/bin/bash
# kern's GPU job (run by the lead: `timeout 170 bash gpu_job.sh` with $OUT set).
# SYNC 1: decode GEMV correctness + timing sweep (tools/gemv_sweep.py), prefill W8A8 comparison.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kern-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.max.memory,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
timeout 163 python3 -m tools.gemv_sweep --budget-s 150 --rows 1,0,8,4,2 2>&1 | tee "$OUT/gemv_sweep.log"
