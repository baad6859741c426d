#!/usr/bin/env bash
# Interleaved A/B of several commits' served decode, in one call on the GPU machine. Across calls the same
# tree's qwen3-8b step has read 4.43-4.52 ms; within a call it repeats to +-0.003 ms (bench/results/2026-12-01-h200-fp8-gemv/, d and e). So
# a change worth a few percent is judged here, never across calls.
#
# Here (no GPU), one tree per commit, bench/results left out to keep the carry small:
#   bash tools/dev/ab_trees.sh main exp/x
# There (carry .whl and .scratch; nothing else needed, the bench builds random weights):
#   bash .scratch/ab/main/tools/ab_served.sh 2 .scratch/ab/main .scratch/ab/exp-x
# AB_ARGS replaces the bench's section arguments, e.g. the cost of a draft round at one context:
#   AB_ARGS="--sections roofline,decode --decode-ks 0 --decode-draft-vocab-ks 1,3 --decode-contexts 512"
# A tree may carry engine switches after a "+", one tree run under each setting:
#   bash .scratch/ab/main/tools/ab_served.sh 2 .scratch/ab/main .scratch/ab/main+NINFER_GEMV_PAIRS=0
# By default each tree runs `tools.bench --sections roofline,quant --quant-decode-only` (bf16, FP8 and NVFP4
# qwen3-8b engines through EngineSession, decode batch 1) in the order A B A B ...; results.json per run under
# $OUT/ab-<tree>-<rep>, packed into ab_runs.tar.gz at the end.
set -u
reps=$1; shift
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# AB_SKIP_INSTALL=1: the packages are there already (a dry run on a CPU machine, with AB_ARGS="--device cpu ...")
[ -n "${AB_SKIP_INSTALL:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
for rep in $(seq "$reps"); do
  for spec in "$@"; do
    tree=${spec%%+*}; switches=()
    [ "$tree" = "$spec" ] || IFS=+ read -r -a switches <<< "${spec#*+}"
    name=$(basename "$tree"); for sw in "${switches[@]}"; do name+="_${sw//[=,]/-}"; done
    echo "=== $name rep $rep $(date -u +%T)"
    commit=$(cat "$tree/COMMIT" 2>/dev/null || echo "$name")
    (cd "$tree" && env "${switches[@]}" PYTHONPATH=/tmp/site:$PWD NINFER_COMMIT=$commit timeout "${AB_TIMEOUT_S:-100}" python3 -m tools.bench --quick \
       ${AB_ARGS:---sections roofline,quant --quant-shapes qwen3-8b --quant-seed-shape '' --quant-decode-only} --budget-s "${AB_BUDGET_S:-80}" \
       --no-plots --out "$OUT/ab-$name-$rep" 2>&1 | grep -E "^quant qwen3-8b|_over_bf16_decode|extra_draft_cost|agg_decode|^  k=")
  done
done
python3 - "$OUT" <<'PY' | tee "$OUT/ab_summary.txt"
import json, pathlib, sys
rows = {}
for f in sorted(pathlib.Path(sys.argv[1]).glob("ab-*/results.json")):
    d = json.loads(f.read_text())
    tree = f.parent.name.rsplit("-", 1)[0]
    seen = set()
    for pair in d["sections"].get("quant", {}).get("pairs", []):
        # every format against bf16, interleaved: each side's reps (bf16 once, from its first pair)
        for side in pair["sides"]:
            if (side, pair["figure"]) in seen:
                continue
            seen.add((side, pair["figure"]))
            for rep in pair["reps"][side]:
                if pair["figure"] == "decode_b1":
                    rows.setdefault((side, tree), []).append(rep["decode_s"] / (rep["completion_tokens"] - 1) * 1e3)
                elif pair["figure"] == "decode_b8" and rep.get("aggregate_tok_s"):
                    # 8 streams: the aggregate as ms per token (lower is better, like the rest)
                    rows.setdefault((side + "/b8", tree), []).append(1e3 / rep["aggregate_tok_s"])
    for p in d["sections"].get("decode", {}).get("points", []):
        if "ms_per_round_best" in p:
            key = f"k={p['draft_tokens']}" + (f"/dv{p['draft_vocab']}" if p.get("draft_vocab") else "") + f"@{p['context']}"
            rows.setdefault((key, tree), []).append(p["ms_per_round_best"])
    for p in d["sections"].get("concurrency", {}).get("points", []):
        # N streams: the aggregate as ms per token, and its ratio to one stream (a point the budget cut has neither)
        if p.get("streams", 1) > 1 and "aggregate_tok_s" in p:
            rows.setdefault((f"streams={p['streams']}", tree), []).append(1e3 / p["aggregate_tok_s"])
            rows.setdefault((f"streams={p['streams']}/x1", tree), []).append(p["aggregate_over_single"])
for (fmt, tree), ms in sorted(rows.items()):
    unit = (" ms per token, 8 streams" if fmt.endswith("/b8") else " x one stream" if fmt.endswith("/x1")
            else " ms per token (aggregate)" if fmt.startswith("streams=") else " ms per round")
    print(f"{fmt:14s} {tree:28s} " + " ".join(f"{m:.3f}" for m in ms) + unit)
PY
# The machine returns at most 8 files a call: the per-run folders go back as one archive beside the summary.
tar -czf "$OUT/ab_runs.tar.gz" -C "$OUT" $(cd "$OUT" && ls -d ab-*/) && rm -rf "$OUT"/ab-*/
