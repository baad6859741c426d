#!/bin/bash
# tpfuse GPU job, SYNC 2 (2 GPUs, <= 120 s): GPU tests of the fused all-reduce + add + RMSNorm and the engine's
# TP2-equals-TP1 (tiny model at ../.models/tiny-qwen3-mtp); qwen3-8b (random weights) TP1 / TP2 / TP2 without
# the K splits / TP2 without fusion: decode b1, 8 streams, prefill 512, kernels per round (tools/tp_points.py);
# the fused kernel's per-call times (tools/tp_fuse_check.py --quick); a summary of the figures last.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -e .models ] || { [ -d ../.models ] && ln -s ../.models .models; }
quiet() { grep --line-buffered -v -e "^20..-..-.. " -e "UserWarning" -e "_warn_once"; }
T0=$(date +%s)
echo "== tpfuse sync2 $(git rev-parse --short HEAD 2>/dev/null) $(date -u +%H:%M:%S)" | tee "$OUT/job.log"
timeout 36 python3 -m pytest -q -p no:cacheprovider -rf tests/test_parallel_gpu.py tests/test_engine_gpu.py \
    -k "fused or (tp2_equals_tp1_fp32 and p2p)" > "$OUT/tests.log" 2>&1
echo "tests rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$OUT/job.log"
timeout 50 python3 tools/tp_points.py --tokens 96 2>&1 | quiet > "$OUT/tp_points.log"
echo "tp_points rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$OUT/job.log"
timeout 24 python3 tools/tp_fuse_check.py --quick 2>&1 | quiet > "$OUT/tp_fuse_check.log"
echo "tp_fuse_check rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$OUT/job.log"
echo "== tests"; grep -E "passed|failed|FAILED|Error" "$OUT/tests.log" | tail -6
echo "== tp_points"; grep -E "^tp|^variant" "$OUT/tp_points.log" | cut -c1-230
echo "== tp_fuse_check"; grep -E "^checks|^largest|^ +[0-9]+ +[0-9]+ +[0-9]+ \||FAILED|^  +1 x" "$OUT/tp_fuse_check.log" | head -16
tail -3 "$OUT/tp_fuse_check.log" | grep -i -E "error|Traceback" ; tail -3 "$OUT/tp_points.log" | grep -i -E "error|Traceback"
echo "== done at $(( $(date +%s) - T0 )) s"
