#!/usr/bin/env bash
# One call on the lent GPU machine: install the carried wheels, keep NVLink multicast off, then run
# the named steps in order, each under its own time limit, logging to $OUT. Usage:
#   bash tools/dev/device_session.sh STEP[:SECONDS] ...
# The machine's copy of .git can be stale (bench runs on 2026-12-02 recorded the first commit sent, "dirty"): name the
# commit that runs in the command, NINFER_COMMIT=$(git rev-parse --short HEAD) written out here, and the bench
# records that (tools/bench/runinfo.py).
# Steps: env, float16, bench-round, small-kernels-tests, fp8-gemv, mma-gemv, mma-tests, bench-quant, skinny-sweep, skinny-tests, prefill-attn, prefill-attn-tests, tune-variants, decode-variant-tests, profile-rows, profile-prefill, profile-quant, quant-tests, profile-ab, hybrid-quant-tests, serve-hybrid, profile-pdl, profile-push, comm-push, kernels-d256, hybrid-tests, profile-hybrid, bench-hybrid, gpu-tests, tp-tests, comm-tests, engine-tests, kernel-tests, tune-attn, bench-kv, kernels, profile, profile-tp, comm, bench-quick, bench, bench-tp, bench-tp-kv.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ "${1:-}" != "--step" ] && [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
elif [ "${1:-}" != "--step" ]; then
  export PYTHONPATH=$PWD
fi
MODEL=.models/tiny-qwen3-mtp

step() {
  case "$1" in
    env) nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv; nvidia-smi topo -m 2>/dev/null
         python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())" ;;
    gpu-tests) python3 -m pytest -q -p no:cacheprovider tests/engine/test_engine_gpu.py tests/engine/kernels/attention/test_paged_gpu.py -m "gpu and not multi_gpu" -s -rA 2>&1 | grep -E "agreement|PASS|FAIL|Error|error|passed|failed" | tail -n 80 ;;
    quant-tests) python3 -m pytest -q -p no:cacheprovider tests/engine/kernels/linear/test_quant_kernels.py tests/engine/quant/test_quant_gpu.py -rA 2>&1 | grep -E "PASS|FAIL|Error|passed|failed" | tail -n 60 ;;
    profile-push) for push in 0 65536; do   # the pull and the push all-reduce (engine/distributed/p2p_push.py), 27B and 8B at TP=2
                   NINFER_P2P_PUSH_MAX_BYTES=$push python3 tools/dev/profile_decode.py --model preset:qwen3.5-27b --context 512 --tensor-parallel-size 2 --steps 10 --modes sync,async --label push$push 2>&1 | grep -v "^20..-..-.. "
                   NINFER_P2P_PUSH_MAX_BYTES=$push python3 tools/dev/profile_decode.py --context 512 --tensor-parallel-size 2 --steps 10 --modes sync,async --label push$push 2>&1 | grep -v "^20..-..-.. " ; done ;;
    profile-ab) for sw in ${AB:-NINFER_PDL=0 NINFER_PDL=1}; do   # one engine switch per run (AB: VAR=VALUE ...)
                  env $sw python3 tools/dev/profile_decode.py --model preset:qwen3.5-27b --context 512 --tensor-parallel-size 2 --steps 10 --modes async --label "ab-${sw//=/}" 2>&1 | grep -v "^20..-..-.. "
                  env $sw python3 tools/dev/profile_decode.py --context 512 --steps 10 --modes async --label "ab-${sw//=/}" 2>&1 | grep -v "^20..-..-.. " ; done ;;
    hybrid-quant-tests) python3 -m pytest -q -p no:cacheprovider tests/engine/quant/test_hybrid_quant_gpu.py tests/engine/models/test_hybrid_gpu.py -k "quantized or packed" -s -rA --durations=6 > "$OUT/hybrid-quant-tests.full.log" 2>&1; grep -vE "^(2026|\[)" "$OUT/hybrid-quant-tests.full.log" | grep -E "rel|agree|PASS|FAIL|Error|passed|failed|s call" | tail -n 40 ;;
    serve-hybrid) # `ninfer serve` of the trained hybrid at TP=2 with MTP, and a client streaming from its gateway
                  python3 -m ninfer.cli.main serve --model .models/tiny-qwen3_5-mtp -tp 2 --num-speculative-tokens 3 --port 50151 --log-level warning > "$OUT/serve-hybrid.server.log" 2>&1 & pid=$!
                  python3 -m ninfer.cli.main generate --gateway 127.0.0.1:50151 --wait-ready 240 --prompt 'def _parse_args(argv=None):' --max-tokens 48 --ignore-eos --json | tail -n 3
                  kill -INT $pid; wait $pid; echo "server exit $?"; tail -n 5 "$OUT/serve-hybrid.server.log" ;;
    comm-push) NINFER_P2P_PUSH_MAX_BYTES=65536 python3 tools/dev/comm_check.py --p2p-max-bytes 67108864 ;;
    profile-pdl) for pdl in 0 1; do   # programmatic dependent launch off / on (engine/kernels/pdl.py)
                   NINFER_PDL=$pdl python3 tools/dev/profile_decode.py --model preset:qwen3.5-27b --context 512 --tensor-parallel-size 2 --steps 10 --modes sync --label pdl$pdl 2>&1 | grep -v "^20..-..-.. "
                   NINFER_PDL=$pdl python3 tools/dev/profile_decode.py --context 512 --steps 10 --modes sync,async --label pdl$pdl 2>&1 | grep -v "^20..-..-.. " ; done ;;
    tp-tests) python3 -m pytest -q -p no:cacheprovider tests/engine/test_engine_gpu.py -m multi_gpu -s -rA 2>&1 | grep -E "PASS|FAIL|Error|passed|failed" | tail -n 40 ;;
    comm-tests) python3 -m pytest -q -p no:cacheprovider tests/engine/distributed/test_communicators_gpu.py -s -rA 2>&1 | grep -E "PASS|FAIL|Error|passed|failed" | tail -n 40 ;;
    kernel-tests) python3 -m pytest -q -p no:cacheprovider tests/engine/kernels/attention/test_int8_upcast.py tests/engine/kernels/attention/test_paged_gpu.py -rA 2>&1 | grep -E "PASS|FAIL|Error|passed|failed" | tail -n 70 ;;
    tune-attn) python3 tools/dev/tune_decode_attention.py --budget-s 100 --out "$OUT/tune_decode.json" ;;
    bench-kv) python3 -m tools.bench --sections roofline,kv --out "$OUT/bench-kv" ;;
    engine-tests) python3 -m pytest -q -p no:cacheprovider tests/engine/test_engine_gpu.py -s -rA -k "int8 or capacity" 2>&1 | grep -E "agreement|used|PASS|FAIL|Error|passed|failed" | tail -n 40 ;;
    kernels) python3 tools/dev/gpu_kernel_suite.py --skip-tests --no-sweep ;;
    profile) for args in "--context 512" "--context 32768" "--context 512 --draft-tokens 3 --draft-vocab 32768"; do
               python3 tools/dev/profile_decode.py $args 2>&1 | grep -v "^20..-..-.. " ; done ;;
    profile-tp) for tp in 1 2; do python3 tools/dev/profile_decode.py --context 512 --tensor-parallel-size $tp 2>&1 | grep -v "^20..-..-.. " ; done ;;
    comm) python3 tools/dev/comm_check.py --p2p-max-bytes 67108864 ;;   # the engine's P2P limit (64 MB)
    bench-quick) python3 -m tools.bench --quick --acceptance-model $MODEL --out "$OUT/bench" ;;
    bench) python3 -m tools.bench --acceptance-model $MODEL --out "$OUT/bench" ;;
    bench-tp) python3 -m tools.bench --sections roofline,tp --time-scale 1.6 --out "$OUT/bench-tp" ;;   # 1.6: room for the 192k run
    bench-tp-kv) python3 -m tools.bench --sections roofline,kv,tp --out "$OUT/bench-tp" ;;
    kernels-attn) python3 -m pytest -q -p no:cacheprovider tests/engine/kernels/attention/test_paged_gpu.py -k "paged_attention" -rA 2>&1 | grep -E "PASS|FAIL|Error|passed|failed" | tail -n 40 ;;
    kernels-d256) python3 -m pytest -q -p no:cacheprovider tests/engine/kernels/attention/test_paged_gpu.py -k "d256" -rA 2>&1 | grep -E "PASS|FAIL|Error|passed|failed" | tail -n 20 ;;
    hybrid-tests) python3 -m pytest -q -x -p no:cacheprovider tests/engine/kernels/gated_delta/test_decode_step.py tests/engine/models/test_hybrid_gpu.py -rA --durations=12 > "$OUT/hybrid-tests.full.log" 2>&1; grep -vE "^(2026|\[)" "$OUT/hybrid-tests.full.log" | tail -n 60 ;;
    hybrid-engine-tests) python3 -m pytest -q -p no:cacheprovider tests/engine/models/test_hybrid_gpu.py -k "graphs or tp2 or (lossless and 3)" -rA --durations=8 > "$OUT/hybrid-engine-tests.full.log" 2>&1; grep -vE "^(2026|\[)" "$OUT/hybrid-engine-tests.full.log" | tail -n 40 ;;
    profile-hybrid) python3 tools/dev/profile_decode.py --model preset:qwen3.5-27b --context 512 --tensor-parallel-size 2 --steps 10 --modes sync,async 2>&1 | grep -v "^20..-..-.. " ;;
    bench-seed) python3 -m tools.bench --sections roofline,quant --quick --budget-s "${SEED_BUDGET_S:-420}" --quant-shapes none --time-scale "${SEED_TIME_SCALE:-2.5}" --out "$OUT/bench-seed" ;;   # qwen3-32b NVFP4 one GPU, 192k (the bench predicted 310 s for the run; 300 cut it)
    bench-hybrid) python3 -m tools.bench --sections roofline,hybrid --quick --budget-s "${HYBRID_BUDGET_S:-220}" \
                    --hybrid-deployments "${HYBRID_DEPLOYMENTS:-tp,one_gpu}" --out "$OUT/bench-hybrid" ;;
    profile-prefill) python3 tools/dev/profile_prefill.py --chunks "${PREFILL_CHUNKS:-1024,2048,4096}" --prompts "${PREFILL_PROMPTS:-4096,16384}" 2>&1 | grep -vE "^(20..-..-.. |USDT|.*UserWarning|  _warn_once|  self.profiler)" ;;   # the chunk-1024 prefill anomaly
    profile-quant) for m in qwen3-8b qwen3-8b-fp8 qwen3-8b-nvfp4; do   # where an FP8 / NVFP4 decode step goes (PDL off: kernel times do not overlap)
                     NINFER_PDL=0 python3 tools/dev/profile_decode.py --model preset:$m --context 512 --steps 10 --modes async --label pdl0 2>&1 | grep -vE "^(20..-..-.. |/opt|  _warn_once)"; done ;;
    profile-rows) # what a second row costs (2 streams, or k=1's verify + draft), PDL off so kernel times add up
                  NINFER_PDL=0 python3 tools/dev/profile_decode.py --context 512 --steps 10 --modes async --batch 1,2 --draft-tokens 0,1 --draft-vocab 32768 --label pdl0 2>&1 | grep -vE "^(20..-..-.. |/opt|  _warn_once)" ;;
    tune-variants) python3 tools/dev/tune_decode_attention.py --variants --budget-s "${TUNE_BUDGET_S:-100}" --out "$OUT/tune_decode_variants.json" ;;
    decode-variant-tests) python3 -m pytest -q -x -p no:cacheprovider tests/engine/kernels/attention/test_paged_gpu.py -k "decode_variants" -rA 2>&1 | grep -E "PASS|FAIL|Error|passed|failed" | tail -n 40 ;;
    prefill-attn) python3 tools/dev/prefill_attention_check.py ;;   # the TMA prefill kernel against the paged one and SDPA
    prefill-attn-tests) python3 -m pytest -q -p no:cacheprovider tests/engine/kernels/attention/test_prefill_tma.py -rA 2>&1 | grep -E "PASS|FAIL|Error|passed|failed" | tail -n 40 ;;
    mma-gemv) python3 -m tools.dev.quant_gemv_mma_check --rows "${MMA_ROWS:-1,2,8}" --budget-s "${MMA_BUDGET_S:-200}" --models "${MMA_MODELS:-}" ;;   # the tensor-core quantized GEMV
    small-kernels-tests) python3 -m pytest -q -p no:cacheprovider tests/engine/kernels/elementwise/test_round_prep.py tests/engine/kernels/linear/test_gemv_silu.py tests/engine/kernels/linear/test_gemv_pairs.py tests/engine/kernels/attention/test_paged_gpu.py -k "pairs or round_prep or gate_up_silu or carry_forward or uniform_context or qk_norm" -rA 2>&1 | grep -E "PASS|FAIL|Error|passed|failed" | tail -n 40 ;;   # the exp/decode-small-kernels branch's kernels
    fp8-gemv) python3 -m tools.dev.gemv_sweep --rows 1 --formats fp8 --budget-s "${SWEEP_BUDGET_S:-170}" ;;   # FP8 decode row, scale after the 16-product sums
    mma-tests) python3 -m pytest -q -p no:cacheprovider tests/engine/kernels/linear/test_quant_gemv_mma.py -rA 2>&1 | grep -E "FAIL|Error|passed|failed" | tail -n 30 ;;
    bench-round) # issue 43 part 3 on one H200 in ~6.5 min (budget 440 s; give the step 480): the quick, robust keys
                 # first, the compiled peer (whole-step Inductor compile, minutes, never timed on a GPU yet) last, so an
                 # overrun costs that key alone; decode right before peer: they share the k=0 engine
                 python3 -m tools.bench --quick --in-given-order --sections roofline,quant,e2e,decode,peer \
                   --quant-shapes qwen3-8b --quant-formats bf16,fp8,nvfp4 --quant-decode-only --quant-mtp-k 0 --quant-seed-shape none \
                   --e2e-tps 1 --e2e-ks 0 --e2e-streams 1,8 --decode-ks 0 --decode-draft-vocab-ks '' --decode-contexts 512 \
                   --peer-parts compiled --peer-compile-mode "${PEER_COMPILE_MODE:-reduce-overhead}" \
                   --budget-s "${BENCH_BUDGET_S:-440}" --no-plots --out "$OUT/bench-round" ;;
    bench-quant) python3 -m tools.bench --quick --sections roofline,peer,decode,quant --quant-shapes qwen3-8b --quant-seed-shape '' --budget-s "${BENCH_BUDGET_S:-240}" --out "$OUT/bench" ;;
    skinny-sweep) python3 -m tools.dev.skinny_bf16_sweep ;;   # bf16 decode rows 2-8 on tensor cores against cuBLAS
    skinny-tests) python3 -m pytest -q -p no:cacheprovider tests/engine/kernels/linear/test_skinny_gemm.py tests/engine/kernels/attention/test_prefill_tma.py -rA 2>&1 | grep -E "FAIL|Error|passed|failed" | tail -n 30 ;;
    float16) # --dtype float16 on silicon (docs/hardware.md, "float16"): the float32-stream norm kernel and its cost,
             # the sm90 / sm70 / sm80 selections against the CPU's float32, and the overflow models of
             # tests/engine/test_float16_overflow.py through the CUDA engine
             python3 -m pytest -q -p no:cacheprovider tests/engine/kernels/elementwise/test_float32_residual.py -rfE 2>&1 | tail -n 3
             python3 -m tools.dev.residual_norm_bench --out "$OUT/residual_norm_bench.json"
             python3 -c "from pathlib import Path; from tests.engine.test_float16_overflow import *
m = Path('$MODEL'); scaled_stream_copy(m, Path('/tmp/f16/scaled'), SCALES[m.name])
massive_neuron_copy(m, Path('/tmp/f16/massive'), 3, 486, NEURON_SCALE)"    # the tiny Qwen3's peak SwiGLU neuron
             for cap in "" 7.0 8.0; do env ${cap:+NINFER_KERNEL_CAPABILITY=$cap} python3 -m tools.dev.capability_check --dtype float16 \
                 --model $MODEL --model /tmp/f16/scaled --model /tmp/f16/massive 2>&1 | grep -E "identical|residual_dtype" | cut -c1-200; done
             for m in $MODEL /tmp/f16/scaled /tmp/f16/massive; do python3 -m tools.dev.float16_headroom $m --device cuda --dtype float16 2>&1 | tail -n 1; done ;;
    *) echo "unknown step $1"; return 2 ;;
  esac
}

if [ "${1:-}" = "--step" ]; then step "$2"; exit $?; fi

for spec in "$@"; do
  name=${spec%%:*}; limit=${spec#*:}; [ "$limit" = "$spec" ] && limit=600
  echo "=== $name (limit ${limit}s) $(date -u +%T)"
  start=$(date +%s)
  timeout --kill-after=15 "$limit" bash "$0" --step "$name" 2>&1 | tee "$OUT/$name.log"
  echo "=== $name rc=${PIPESTATUS[0]} in $(( $(date +%s) - start ))s"
done
