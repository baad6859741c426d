#!/usr/bin/env bash
# issue 15 item 2 (async scheduling, engine.overlap) on the GPU machine; <= 120 s at SYNC 2.
# Uses preset:qwen3-8b (random weights) and ../.models/tiny-qwen3-mtp (the GPU tests).
#   1. before: tools/profile_decode.py on the base commit's engine (.overlap-base/, `git archive` of
#      main, the commit this branch is rebased on), k = 0 and 3, b = 1 and 8 (it schedules synchronously)
#   2. after: the same tool on this commit, k = 0 and 3, b = 1 and 8, sync (every round waits for the
#      last: --no-async-scheduling, same graphs) and async; ms per round and GPU idle per round
#      (wall time less cuda:0 kernel time)
#   3. GPU tests of tests/test_engine_gpu.py (single GPU) that bear on this change, with what is left
set -u
OUT=${OUT:-/tmp/out-overlap}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
BUDGET=${BUDGET:-116}
left() { echo $((BUDGET - ($(date +%s) - T0))); }
COMMIT=$(cat .jobcommit 2>/dev/null || echo unknown)
BASE=$(cat .overlap-base/COMMIT 2>/dev/null || echo none)
echo "overlap job: commit $COMMIT, base $BASE, $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee "$OUT/gpu.txt"
quiet() { grep -v "^20..-..-.. \|^USDT\|UserWarning\|self.profiler = \|_warn_once" ; }

if [ -d .overlap-base/engine ]; then
  PYTHONPATH=$PWD/.overlap-base:${PYTHONPATH:-$PWD} timeout 36 python tools/profile_decode.py --context 512 \
      --draft-tokens 0,3 --batch 1,8 --modes sync --steps 20 --label "base-$BASE" 2>&1 | quiet > "$OUT/profile-base.log"
  echo "before (base $BASE):"; grep -A5 "^batch" "$OUT/profile-base.log" || grep "ms per round" "$OUT/profile-base.log"
fi

timeout $(( $(left) - 32 )) python tools/profile_decode.py --context 512 --draft-tokens 0,3 --batch 1,8 \
    --modes sync,async --steps 20 --label "$COMMIT" 2>&1 | quiet > "$OUT/profile.log"
echo "after ($COMMIT):"; grep -A9 "^batch" "$OUT/profile.log" || grep "ms per round" "$OUT/profile.log"

T=tests/test_engine_gpu.py
# in this order (the ones on this change first), in what time is left
timeout $(( $(left) - 2 )) python -m pytest -q -rs -p no:cacheprovider -m "gpu and not multi_gpu" \
    "$T::test_async_scheduling_equals_synchronous_with_graphs_fp32" "$T::test_cuda_graphs_equal_eager_fp32" \
    "$T::test_greedy_speculative_equals_k0_fp32" "$T::test_adaptive_draft_length_with_graphs_equals_k0_fp32" \
    "$T::test_sampled_decoding_is_reproducible_on_gpu" "$T::test_packed_prefill_equals_prompts_prefilled_alone_fp32" \
    2>&1 | quiet > "$OUT/gpu-tests.log"
tail -6 "$OUT/gpu-tests.log"
echo "done in $(( $(date +%s) - T0 )) s"
