#!/bin/bash
# kern's SYNC 2 GPU job (copied to gpu_job.sh): engine-level figures, then the GPU tests, in 165 s.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kern-out}; mkdir -p "$OUT"
t0=$(date +%s)
left() { echo $((163 - ($(date +%s) - t0))); }
# 1. the quant section (qwen3-8b first: the headline keys; qwen3-32b points are skipped if the budget is short)
timeout 88 python3 -m tools.bench --sections roofline,quant --quick --budget-s 80 --no-plots --out "$OUT/bench" \
    > "$OUT/bench.log" 2>&1
echo "bench rc=$? ($(( $(date +%s) - t0 )) s)"
grep -E "quant  |roofline" "$OUT/bench.log" | tail -14
grep -E "over_bf16|roofline_fraction" "$OUT/bench/summary.md" | head -8
# 2. the kernels against the reference (GEMV, skinny, dequantize, W8A8, activation quantization)
timeout 45 python3 -m pytest -q -p no:cacheprovider tests/test_quant_kernels.py > "$OUT/kernels_pytest.log" 2>&1
echo "kernel tests rc=$? ($(( $(date +%s) - t0 )) s)"; tail -3 "$OUT/kernels_pytest.log"
# 3. the engine on the quantized tiny model (graphs, MTP, TP2) with the time left
t=$(left); [ "$t" -gt 15 ] && timeout "$t" python3 -m pytest -q -p no:cacheprovider tests/test_quant_gpu.py \
    > "$OUT/gpu_pytest.log" 2>&1
echo "engine tests rc=$? ($(( $(date +%s) - t0 )) s)"; tail -4 "$OUT/gpu_pytest.log"
