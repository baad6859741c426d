#!/bin/bash
# kern's SYNC 2 GPU job (<= 120 s): prefill routes at 4k (chooses the FP8 prefill route for the run), the
# engine-level quant figures on qwen3-8b, then the GPU tests of the quantized paths with the time left.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kern-out}; mkdir -p "$OUT"
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
# 1. prefill at 4096 tokens, qwen3-8b qkv and gate_up: bf16 cuBLAS, FP8 via torch's block-scaled GEMM (fused
#    activation quantization), the Triton block GEMM, dequantize + cuBLAS; NVFP4 dequantize + cuBLAS
timeout 24 python3 -m tools.gemv_sweep --rows 0 --no-checks --prefill-layers qkv,gate_up \
    --prefill-configs 128x128w8s3 > "$OUT/prefill.log" 2>&1
grep -E "^prefill|routes|WINNER|ERROR" "$OUT/prefill.log" | cut -c1-150
w=$(grep -o "FP8_PREFILL_WINNER=[a-z]*" "$OUT/prefill.log" | cut -d= -f2)
[ -n "$w" ] && sed -i "s/^FP8_PREFILL = .*/FP8_PREFILL = \"$w\"/" engine/kernels/quant_gemm.py
echo "FP8_PREFILL for this run: $(grep '^FP8_PREFILL = ' engine/kernels/quant_gemm.py) ($(el) s)"
# 2. the engine: quant section (bf16, FP8, NVFP4 engines of qwen3-8b; qwen3-32b is skipped by the budget)
timeout 62 python3 -m tools.bench --sections roofline,quant --quick --budget-s 56 --no-plots --out "$OUT/bench" \
    > "$OUT/bench.log" 2>&1
echo "bench rc=$? ($(el) s)"
grep -E "\] quant |copy" "$OUT/bench.log" | cut -c1-170 | tail -9
grep -E "over_bf16|decode_b1_roofline" "$OUT/bench/summary.md" | cut -c1-120 | head -6
# 3. GPU tests: the engine on the quantized tiny model (graphs, MTP, TP2), then the kernels
t=$(( 117 - $(el) )); [ "$t" -gt 10 ] && timeout "$t" python3 -m pytest -q -p no:cacheprovider \
    tests/test_quant_gpu.py tests/test_quant_kernels.py > "$OUT/gpu_pytest.log" 2>&1
echo "tests rc=$? ($(el) s)"; grep -E "passed|failed|FAILED|Error" "$OUT/gpu_pytest.log" | tail -6
