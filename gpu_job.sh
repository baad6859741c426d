#!/bin/bash
# tpfuse GPU job, SYNC 1 (2 GPUs): the fused all-reduce + add + RMSNorm kernel checked and timed against
# the unfused ops (tools/tp_fuse_check.py); qwen3-8b (random weights) TP=2 decode b1 profiled with the
# fused kernel; the engine's TP2-equals-TP1 test on the tiny model (../.models/tiny-qwen3-mtp); a
# split-K probe (tools/splitk_probe.py).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -e .models ] || { [ -d ../.models ] && ln -s ../.models .models; }
quiet() { grep -v -e "^20..-..-.. " -e "UserWarning" -e "_warn_once"; }
echo "== tpfuse sync1 $(git rev-parse --short HEAD 2>/dev/null) $(date -u +%H:%M:%S)"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
echo "== fused kernel: checks, then us per call in graphs (unfused = P2P all-reduce + norm kernel(s))"
timeout 70 python3 tools/tp_fuse_check.py 2>&1 | quiet | tee "$OUT/tp_fuse_check.log"
echo "== profile qwen3-8b TP2 ctx 512 k0, fused $(date -u +%H:%M:%S)"
timeout 38 python3 tools/profile_decode.py --context 512 --tensor-parallel-size 2 --steps 20 2>&1 | quiet \
    | tee "$OUT/profile_tp2_fused.log"
echo "== engine TP2 equals TP1 (p2p, graphs) $(date -u +%H:%M:%S)"
timeout 42 python3 -m pytest -q -x -p no:cacheprovider tests/test_engine_gpu.py -k "tp2_equals_tp1_fp32 and p2p" \
    2>&1 | tail -15 | tee "$OUT/tests_engine_tp2.log"
echo "== split-K probe (1 GPU) $(date -u +%H:%M:%S)"
timeout 14 python3 tools/splitk_probe.py 2>&1 | quiet | tee "$OUT/splitk_probe.log"
echo "== done $(date -u +%H:%M:%S)"
