#!/usr/bin/env bash
# issue 15 item 2 (async scheduling, engine.overlap) on the GPU machine; <= 170 s.
# Uses preset:qwen3-8b (random weights) and ../.models/tiny-qwen3-mtp (the GPU tests).
#   1. GPU tests (SYNC 1: the async ones and graphs = eager; SYNC 2: every single-GPU one)
#   2. tools/profile_decode.py: ms per round and GPU idle per round (wall less cuda:0 kernel time),
#      b = 1 and 8, k = 0 and 3, sync (every round waits for the last) against async, same build
#   3. the same profile on the base commit's engine (.overlap-base/, exported by `git archive`), sync only
set -u
OUT=${OUT:-/tmp/out-overlap}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
left() { echo $((165 - ($(date +%s) - T0))); }
COMMIT=$(cat .jobcommit 2>/dev/null || echo unknown)
STAGE=${STAGE:-$(cat .jobstage 2>/dev/null || echo sync1)}
echo "overlap job: commit $COMMIT stage $STAGE"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
quiet() { grep -v "^20..-..-.. \|^USDT\|UserWarning\|self.profiler = " ; }

if [ "$STAGE" = sync2 ]; then
  timeout 75 python -m pytest -q -p no:cacheprovider -m "gpu and not multi_gpu" \
      tests/test_engine_gpu.py 2>&1 | quiet > "$OUT/gpu-tests.log"
  tail -15 "$OUT/gpu-tests.log"
else
  timeout 45 python -m pytest -q -p no:cacheprovider -m "gpu and not multi_gpu" \
      tests/test_engine_gpu.py -k "async or eager" 2>&1 | quiet > "$OUT/gpu-tests-async.log"
  tail -15 "$OUT/gpu-tests-async.log"
fi

# one process, one engine per k (each profile row is printed and written as it is measured)
timeout $(( $(left) - 30 )) python tools/profile_decode.py --context 512 --draft-tokens 0,3 --batch 1,8 \
    --modes sync,async --steps 20 --label "$COMMIT" 2>&1 | quiet > "$OUT/profile.log"
grep -A9 "^batch" "$OUT/profile.log" || { grep "ms per round" "$OUT/profile.log"; tail -5 "$OUT/profile.log"; }

if [ -d .overlap-base/engine ] && [ "$(left)" -gt 25 ]; then
  BASE=$(cat .overlap-base/COMMIT)
  PYTHONPATH=$PWD/.overlap-base:${PYTHONPATH:-$PWD} timeout $(( $(left) - 3 )) python tools/profile_decode.py --context 512 \
      --draft-tokens 0 --batch 1,8 --modes sync --steps 20 --label "base-$BASE" 2>&1 | quiet > "$OUT/profile-base-k0.log"
  echo "base $BASE:"; grep -A4 "^batch" "$OUT/profile-base-k0.log" || { grep "ms per round" "$OUT/profile-base-k0.log"; tail -3 "$OUT/profile-base-k0.log"; }
fi
echo "done in $(( $(date +%s) - T0 )) s"
