"""The headline keys, each derived from the raw figures its section recorded (tools/bench/targets.py
lists them with their targets; tools/bench/interleave.py states the rule).

Where each key's raw figures live in results.json:

    decode_b1_roofline_fraction      decode.points (k=0, reference context): floor / ms per rep
    decode_b1_over_compiled_peer     peer.compiled_decode_pair: compiled_peer ms / engine ms per rep
    prefill_{4k,32k}_vs_transformers peer.prefill_pairs (P): engine / transformers tok/s per rep
    prefill_4k_mfu                   prefill.points (reference P and chunk): MFU per rep
    prefill_32k_over_4k              prefill.points (reference chunk), interleaved rounds: 32k / 4k per round
    extra_draft_cost_fraction        decode.round_cost_pairs: (ms(k) - ms(0)) / (k ms(0)) per rep
    tp2_over_tp1_*                   tp.pairs (decode_b1, streams, prefill_P): TP2 / TP1 per rep
    tp2_32b_roofline_fraction        tp.points (tp2-big)
    agg_decode_{2,8}_streams         concurrency.points[].reps, interleaved rounds: aggregate(N) / aggregate(1)
    ttft_8x512_over_single           concurrency.ttft_burst: median burst TTFT / TTFT alone per round
    int8_over_bf16_kv_decode_32k     kv.pairs (reference context)
    e2e_*                            e2e.configs (tp1-k0): ttft (served - in-process per pair, >= 32 pairs), streams
    *_over_bf16_*, *_roofline_fraction (formats), nvfp4_mtp3_b1_implied_tok_s
                                     quant.pairs / quant.mtp_pair (+ acceptance: prose, T=0)
    structured_decode_overhead_b*    structured.pairs.b1 / .b32: interleaved records with sides
                                     "unconstrained" and "structured", each rep's `decode_tok_s` (batch 32:
                                     the batch's aggregate); overhead = unconstrained / structured - 1 per rep;
                                     else structured.points[] (batch, share: mask fill / step, on a GPU)
    hybrid_*                         hybrid.points / long_context / one_gpu
    moe_30b_a3b_*                    moe.points (tp1), moe.pairs.decode_b1
    pd_kv_transfer_gbps              pd.transfer: the median of the consumer's pulls (a GPU run's only)
"""

from __future__ import annotations

from typing import Any

from tools.bench import interleave, shapes
from tools.bench.raw import measured as _measured, rep_ms_per_round, roofline_of
from tools.bench.targets import TARGETS

E2E_TTFT_MIN_SAMPLES = 32


class Keys:
    """The keys as they are derived: value (or reason), inputs, rule, per-rep figures, TP size."""

    def __init__(self, secs: dict):
        self.secs = secs
        self.rows: dict[str, dict[str, Any]] = {}

    def missing(self, section: str) -> str:
        s = self.secs.get(section)
        if s is None:
            return f"section {section} not run"
        if s.get("status") in ("error", "skipped", "interrupted"):
            return f"section {section} {s['status']}: {s.get('reason') or s.get('error', '')}".strip()
        return ""

    def put(self, name: str, reduced: dict, tp, **inputs) -> None:
        """A key from a reduced figure (interleave.reduce_*): its value, or its reason."""
        self.rows[name] = {"value": reduced["value"], "reason": reduced["reason"], "rule": reduced["rule"],
                           "per_rep": reduced["per_rep"], "tp": tp, "inputs": inputs}

    def flag(self, name: str, value, tp, inputs: dict | None = None) -> None:
        """A yes/no key (a run that went through or not)."""
        self.rows[name] = {"value": value, "reason": None, "rule": "the request's outcome", "per_rep": None,
                           "tp": tp, "inputs": inputs or {}}

    def miss(self, name: str, *reasons: str | None) -> None:
        self.rows[name] = {"value": None, "reason": next((r for r in reasons if r), "not measured")}


def _tp_of(engine: dict | None, default: int = 1) -> int:
    return int((engine or {}).get("tensor_parallel_size", default))


def compute(results: dict) -> tuple[dict, dict]:
    secs = results.get("sections", {})
    ref = results.get("plan", {}).get("reference", {})
    keys = Keys(secs)
    for part in (_decode, _peer, _prefill, _tp, _concurrency, _kv, _e2e, _quant, _structured, _hybrid, _moe):
        part(keys, results, ref)
    _pd(keys, results)

    head, detail = {}, {}
    for name, t in TARGETS.items():
        row = keys.rows.get(name) or {"value": None, "reason": "not derived"}
        v, reason, tp = row["value"], row.get("reason"), row.get("tp")
        if isinstance(tp, dict):                          # a TP comparison: the subject's size, and its baseline's
            base, tp = min(tp.values()), max(tp.values())
        else:
            base = None
        if v is not None and tp is not None and tp != t.tp:
            reason = f"measured at TP={tp} ({v:.4g}); the target is stated at TP={t.tp}: the figure stays in its section"
            v = None
        head[name] = v
        met = ratio = None
        if v is not None and t.comparison is not None:
            if t.comparison == ">=":
                met, ratio = v >= t.value, v / t.value
            elif t.comparison == "<=":
                met, ratio = v <= t.value, (t.value / v if v > 0 else None)
            else:
                met = v == t.value
        detail[name] = {"value": v, "target": t.value, "comparison": t.comparison, "target_text": t.text, "met": met,
                        "ratio_to_target": ratio, "tensor_parallel_size": tp if tp is not None else t.tp,
                        "baseline_tensor_parallel_size": base, "target_tensor_parallel_size": t.tp,
                        "rule": row.get("rule"), "per_rep": row.get("per_rep"), "inputs": row.get("inputs"),
                        "reason": None if v is not None else reason}
    return head, detail


# -- one function per section --------------------------------------------------------------------

def _decode(keys: Keys, results: dict, ref: dict) -> None:
    sec = keys.secs.get("decode", {})
    ctx = ref.get("decode_context")
    d0 = [p for p in _measured(sec.get("points", []))
          if p["draft_tokens"] == 0 and p["context"] == ctx and not p.get("draft_vocab")]
    name = "decode_b1_roofline_fraction"
    if d0 and d0[0].get("roofline_fraction_per_rep"):
        keys.put(name, interleave.reduce_values(d0[0]["roofline_fraction_per_rep"]), _tp_of(d0[0].get("engine")),
                 context=ctx, floor_ms=d0[0]["floor_ms"], ms_per_round_median=d0[0]["ms_per_round_median"])
    else:
        keys.miss(name, keys.missing("decode"), "no roofline measured" if d0 else f"no k=0 decode point at context {ctx}")

    options = {}
    for pair in sec.get("round_cost_pairs", []):
        if pair.get("context") != ctx:
            continue
        k = pair["k"]
        r = interleave.reduce_pair(pair, "k", "k0", rep_ms_per_round)
        per_rep = [(x - 1) / k for x in r["per_rep"]]
        options.setdefault(pair.get("draft_vocab") or 0, {})[k] = interleave.reduce_values(
            per_rep, f"paired reps of k={k} and k=0", interleave.RULE_RATIO)
    complete = {dv: ks for dv, ks in options.items() if ks and all(r["value"] is not None for r in ks.values())}
    name = "extra_draft_cost_fraction"
    if complete:
        costs = {dv: sum(r["value"] for r in ks.values()) / len(ks) for dv, ks in complete.items()}
        dv = min(costs, key=costs.get)
        keys.put(name, {"value": costs[dv], "reason": None, "per_rep": {str(k): r["per_rep"] for k, r in complete[dv].items()},
                        "rule": "mean over k of the median of the per-rep (ms(k) / ms(0) - 1) / k of interleaved reps"},
                 1, context=ctx, draft_vocab=dv or "full",
                 per_k={str(k): r["value"] for k, r in sorted(complete[dv].items())},
                 options={str(d or "full"): c for d, c in costs.items()})
    else:
        reasons = [r["reason"] for ks in options.values() for r in ks.values() if r["reason"]]
        keys.miss(name, keys.missing("decode"), *reasons,
                  f"needs interleaved k=0 / k>=1 reps at context {ctx} (decode.round_cost_pairs)")


def _peer(keys: Keys, results: dict, ref: dict) -> None:
    sec = keys.secs.get("peer", {})
    comp, pair = sec.get("compiled_decode") or {}, sec.get("compiled_decode_pair")
    name = "decode_b1_over_compiled_peer"
    if pair and comp.get("compiled") and pair.get("context") == ref.get("decode_context"):
        keys.put(name, interleave.reduce_pair(pair, "compiled_peer", "engine", "ms_per_token"),
                 pair.get("tensor_parallel_size", 1), context=pair["context"], tokens=pair.get("tokens"),
                 mode=comp.get("mode"), cuda_graph=comp.get("cuda_graph"))
    else:
        keys.miss(name, keys.missing("peer"), comp.get("error"), comp.get("skipped"), comp.get("note"),
                  f"needs the compiled peer's interleaved pair at context {ref.get('decode_context')}")
    pairs = {p.get("P"): p for p in sec.get("prefill_pairs", [])}
    for name, P in (("prefill_4k_vs_transformers", ref.get("prefill_P")),
                    ("prefill_32k_vs_transformers", ref.get("prefill_long_P"))):
        if P in pairs:
            keys.put(name, interleave.reduce_pair(pairs[P], "engine", "transformers", "prefill_tok_s", metric_b="tok_s"),
                     pairs[P].get("tensor_parallel_size", 1), P=P, chunk=pairs[P].get("chunk"))
        else:
            keys.miss(name, keys.missing("peer"), f"no interleaved engine / transformers pair at P={P}")


def _prefill(keys: Keys, results: dict, ref: dict) -> None:
    sec = keys.secs.get("prefill", {})
    P, P2, chunk = ref.get("prefill_P"), ref.get("prefill_long_P"), ref.get("prefill_chunk")
    pre = {p["P"]: p for p in _measured(sec.get("points", [])) if p["chunk"] == chunk}
    if P in pre and pre[P].get("mfu_per_rep"):
        keys.put("prefill_4k_mfu", interleave.reduce_values(pre[P]["mfu_per_rep"]), _tp_of(pre[P].get("engine")),
                 P=P, chunk=chunk, tok_s_median=pre[P]["prefill_tok_s_median"])
    else:
        keys.miss("prefill_4k_mfu", keys.missing("prefill"), "no roofline measured" if P in pre else f"no P={P} point")
    order = [x for x in (sec.get("order") or {}).get(str(chunk), []) if x in (P, P2)]
    if P in pre and P2 in pre and order[:2] != [P, P2]:
        keys.miss("prefill_32k_over_4k", f"P={P} and P={P2} were not measured in interleaved rounds (no order recorded)")
    elif P in pre and P2 in pre:
        record = {"reps": {"long": pre[P2]["repeats"], "ref": pre[P]["repeats"]}}
        keys.put("prefill_32k_over_4k", interleave.reduce_pair(record, "long", "ref", "prefill_tok_s"),
                 _tp_of(pre[P].get("engine")), P=[P, P2], chunk=chunk)
    else:
        keys.miss("prefill_32k_over_4k", keys.missing("prefill"), f"needs P={P} and P={P2} at chunk {chunk}")


def _tp(keys: Keys, results: dict, ref: dict) -> None:
    sec = keys.secs.get("tp", {})
    pairs = sec.get("pairs", {})
    for name, figure, metric in (("tp2_over_tp1_decode_b1", "decode_b1", "decode_tok_s"),
                                 ("tp2_over_tp1_agg_8", "streams", "aggregate_tok_s"),
                                 ("tp2_over_tp1_prefill_512", f"prefill_{ref.get('tp_prefill_P', 512)}", "prefill_tok_s")):
        pair = pairs.get(figure) or {}
        if "sides" in pair:
            keys.put(name, interleave.reduce_pair(pair, "tp2", "tp1", metric), pair.get("tensor_parallel_size"),
                     figure=figure, **{k: pair[k] for k in ("context", "streams", "P") if k in pair})
        else:
            keys.miss(name, keys.missing("tp"), pair.get("skipped"), f"no interleaved TP1 / TP2 {figure} pair")
    big = [p for p in _measured(sec.get("points", [])) if p.get("label") == "tp2-big"]
    name = "tp2_32b_roofline_fraction"
    if big and big[0].get("roofline_fraction_per_rep"):
        keys.put(name, interleave.reduce_values(big[0]["roofline_fraction_per_rep"]), _tp_of(big[0].get("engine")),
                 shape=big[0].get("shape"), context=big[0]["context"], kv_dtype="int8", floor_ms=big[0].get("floor_ms"))
    else:
        keys.miss(name, keys.missing("tp"), sec.get(name + "_reason"), "no large-shape TP2 point with a roofline")
    if sec.get("context_192k_ok") is not None:
        inputs = sec.get("context_192k_ok_inputs", {})
        keys.flag("context_192k_ok", sec["context_192k_ok"], inputs.get("tensor_parallel_size", 2), inputs)
    else:
        keys.miss("context_192k_ok", keys.missing("tp"), sec.get("context_192k_ok_reason"))


def _concurrency(keys: Keys, results: dict, ref: dict) -> None:
    sec = keys.secs.get("concurrency", {})
    conc = {p["streams"]: p for p in _measured(sec.get("points", []))}
    tp = _tp_of((sec.get("setup") or {}).get("engine"))
    for name, n in (("agg_decode_2_streams", ref.get("streams_small", 2)), ("agg_decode_8_streams", ref.get("streams_large", 8))):
        if n in conc and 1 in conc and not sec.get("order"):
            keys.miss(name, f"N=1 and N={n} were not measured in interleaved rounds (no order recorded)")
        elif n in conc and 1 in conc:
            record = {"reps": {"n": conc[n].get("reps", []), "one": conc[1].get("reps", [])}}
            keys.put(name, interleave.reduce_pair(record, "n", "one", "aggregate_tok_s"), tp, streams=n)
        else:
            keys.miss(name, keys.missing("concurrency"), f"needs N=1 and N={n}")
    burst = sec.get("ttft_burst") or {}
    name = "ttft_8x512_over_single"
    if burst.get("alone") and not burst.get("order"):
        keys.miss(name, "the prompts alone and the bursts were not measured in interleaved rounds (no order recorded)")
    elif burst.get("alone"):
        from tools.bench.burst import round_ratio
        per_round = [round_ratio(a, b) for a, b in zip(burst["alone"], burst["bursts"])]
        keys.put(name, interleave.reduce_values(per_round, "rounds", interleave.RULE_RATIO), tp,
                 streams=burst["streams"], prompt=burst["prompt"], prefill_chunk=burst["prefill_chunk"])
    else:
        keys.miss(name, keys.missing("concurrency"), burst.get("skipped"))


def _kv(keys: Keys, results: dict, ref: dict) -> None:
    sec = keys.secs.get("kv", {})
    pair = next((p for p in sec.get("pairs", []) if p.get("context") == ref.get("kv_context")), None)
    name = "int8_over_bf16_kv_decode_32k"
    if pair:
        keys.put(name, interleave.reduce_pair(pair, "int8", pair["base_kv_dtype"], "decode_tok_s"),
                 pair.get("tensor_parallel_size", 1), context=pair["context"], base_kv_dtype=pair["base_kv_dtype"])
    else:
        keys.miss(name, keys.missing("kv"), sec.get("int8_over_bf16_reason"),
                  f"no interleaved pair at context {ref.get('kv_context')}")


def _e2e(keys: Keys, results: dict, ref: dict) -> None:
    sec = keys.secs.get("e2e", {})
    c = next((c for c in sec.get("configs", []) if c.get("label") == "tp1-k0" and "ttft" in c), None)
    names = ("e2e_ttft_added_ms", "e2e_decode_b1_over_inproc", "e2e_agg_8_over_inproc")
    if c is None:
        for name in names:
            keys.miss(name, keys.missing("e2e"), sec.get("e2e_reason"))
        return
    fields = {"config": "tp1-k0", "prompt": c.get("prompt"), "decode_tokens": c.get("decode_tokens")}
    keys.put(names[0], interleave.reduce_pair(c["ttft"], "served", "inproc", "ttft_ms", op="difference",
                                              minimum=E2E_TTFT_MIN_SAMPLES), c.get("tensor_parallel_size", 1), **fields)
    streams = sorted(int(n) for n in c["streams"])
    big = 8 if 8 in streams else max(streams)
    for name, n in ((names[1], 1), (names[2], big)):
        pair = c["streams"].get(str(n))
        keys.put(name, interleave.reduce_pair(pair, "served", "inproc", "aggregate_tok_s"),
                 c.get("tensor_parallel_size", 1), streams=n, **fields)


def _quant(keys: Keys, results: dict, ref: dict) -> None:
    sec = keys.secs.get("quant", {})
    shape = sec.get("headline_shape")
    pairs = {(p["format"], p["figure"]): p for p in sec.get("pairs", []) if p.get("shape") == shape}
    points = {p["format"]: p for p in sec.get("points", []) if p.get("shape") == shape}
    for name, fmt, figure, metric in (("nvfp4_over_bf16_decode_b1", "nvfp4", "decode_b1", "decode_tok_s"),
                                      ("fp8_over_bf16_decode_b1", "fp8", "decode_b1", "decode_tok_s"),
                                      ("w4a16_over_bf16_decode_b1", "w4a16", "decode_b1", "decode_tok_s"),
                                      ("fp16_over_bf16_decode_b1", "fp16", "decode_b1", "decode_tok_s"),
                                      ("fp8_over_bf16_prefill_4k", "fp8", "prefill", "prefill_tok_s")):
        pair = pairs.get((fmt, figure))
        if pair:
            keys.put(name, interleave.reduce_pair(pair, fmt, "bf16", metric), pair.get("tensor_parallel_size", 1),
                     shape=shape, format=fmt, **({"P": pair.get("P")} if figure == "prefill" else {"context": pair.get("context")}))
        else:
            keys.miss(name, keys.missing("quant"), (points.get(fmt) or {}).get("skipped"),
                      f"no interleaved {fmt} / bf16 {figure} pair on {shape}")
    bw, _ = roofline_of(results, sec.get("run_id"))
    for fmt in ("fp8", "nvfp4"):
        name, pair = f"{fmt}_decode_b1_roofline_fraction", pairs.get((fmt, "decode_b1"))
        step = (points.get(fmt) or {}).get("decode_bytes_per_step")
        if pair and bw and step:
            per_rep = [step / bw * 1e3 / m for m in interleave.values(pair, fmt, rep_ms_per_round) if m]
            keys.put(name, interleave.reduce_values(per_rep), 1, shape=shape, bytes_per_step=step)
        else:
            keys.miss(name, keys.missing("quant"), f"no {fmt} decode pair with a roofline on {shape}")
    _moonshot(keys, sec)
    seed = sec.get("seed_one_gpu") or {}
    name = "seed_32b_nvfp4_one_gpu_192k_ok"
    if seed.get(name) is not None:
        keys.flag(name, seed[name], 1, seed.get(name + "_inputs"))
    else:
        keys.miss(name, keys.missing("quant"), seed.get(name + "_reason"), seed.get("reason"))


def _moonshot(keys: Keys, sec: dict) -> None:
    """NVFP4 + MTP at batch 1: tokens per round at the trained model's prose acceptance (T = 0) over
    each rep's ms per round, then the median."""
    name, pair = "nvfp4_mtp3_b1_implied_tok_s", sec.get("mtp_pair")
    acc = [e for e in keys.secs.get("acceptance", {}).get("results", []) if "skipped" not in e
           and e.get("workload") == "prose" and e.get("temperature") == 0 and pair and e.get("k") == pair.get("k")]
    if not pair:
        return keys.miss(name, keys.missing("quant"), sec.get("mtp_reason"), "no NVFP4 k=3 / k=0 pair (quant.mtp_pair)")
    if not acc:
        return keys.miss(name, keys.missing("acceptance"), f"no prose acceptance at k={pair['k']}, T=0")
    tpr = acc[0]["tokens_per_round"]
    per_rep = [tpr / m * 1e3 for m in interleave.values(pair, "mtp", rep_ms_per_round) if m]
    keys.put(name, interleave.reduce_values(per_rep), pair.get("tensor_parallel_size", 1), shape=pair.get("shape"),
             k=pair["k"], draft_vocab=pair.get("draft_vocab") or "full", tokens_per_round=tpr,
             round_over_k0_step=interleave.reduce_pair(pair, "mtp", "k0", rep_ms_per_round)["value"])


def _structured(keys: Keys, results: dict, ref: dict) -> None:
    """Two layouts: interleaved pairs (`pairs.b1`, `.b32`: sides unconstrained / structured, overhead =
    unconstrained / structured - 1 per rep, the median), or the mask-fill points of the request-structured
    branch's section (`points[]`: `batch`, `share` = the median host fill of b masks over the median
    unconstrained step at batch b, `device`), which is a share, not an A/B of decode rates, and says so."""
    sec = keys.secs.get("structured", {})
    pairs = sec.get("pairs") or {}
    points = {p.get("batch"): p for p in _measured(sec.get("points", []))}
    for name, batch in (("structured_decode_overhead_b1", 1), ("structured_decode_overhead_b32", 32)):
        pair, point = pairs.get(f"b{batch}"), points.get(batch)
        if pair:
            r = interleave.reduce_pair(pair, "unconstrained", "structured", "decode_tok_s")
            r = {**r, "value": None if r["value"] is None else r["value"] - 1, "per_rep": [x - 1 for x in r["per_rep"]]}
            keys.put(name, r, pair.get("tensor_parallel_size", 1), batch=f"b{batch}")
        elif point and point.get("device") != "cpu" and point.get("share") is not None:
            keys.put(name, {"value": point["share"], "reason": None, "per_rep": None,
                            "rule": "median host time to fill the batch's JSON-schema masks over the median "
                                    "unconstrained decode step at that batch (not an interleaved A/B)"},
                     1, batch=f"b{batch}", fill_ms_median=point.get("fill_ms_median"), step_ms=point.get("step_ms"),
                     steps=point.get("steps"))
        else:
            keys.miss(name, keys.missing("structured"), "CPU dry run: the GPU run takes the figure" if point else None,
                      f"no interleaved structured / unconstrained b{batch} pair")


def _pd(keys: Keys, results: dict) -> None:
    """pd.transfer: the median GB/s of the consumer's pulls; the key is the GPU figure (two engines' device
    memory over NVLink or RDMA), so a CPU run's figure (host memory between two processes) stays in its section."""
    sec = keys.secs.get("pd", {})
    t = sec.get("transfer") or {}
    name = "pd_kv_transfer_gbps"
    if not t.get("pulls"):
        keys.miss(name, keys.missing("pd"), t.get("reason"), "no pull measured")
    elif (sec.get("engines") or {}).get("device") == "cpu":
        keys.miss(name, f"CPU run: {t['gb_per_s_median']:.3g} GB/s median over {t['pulls']} pulls between two "
                        "processes of one host (section pd); the key is the GPU run's figure")
    else:
        keys.put(name, {"value": t["gb_per_s_median"], "reason": None, "rule": interleave.RULE_MEDIAN,
                        "per_rep": [p["gb_per_s"] for p in t.get("per_pull", [])]},
                 1, pulls=t["pulls"], bytes_median=t["bytes_median"], ms_median=t["ms_median"])


def _hybrid(keys: Keys, results: dict, ref: dict) -> None:
    hyb = keys.secs.get("hybrid", {})
    tp = hyb.get("tensor_parallel_size")
    name = "hybrid_27b_tp2_decode_roofline_fraction"
    hp = sorted(_measured(hyb.get("points", [])), key=lambda p: p["context"])     # the shortest context first
    if hp and hp[0].get("roofline_fraction_per_rep"):
        keys.put(name, interleave.reduce_values(hp[0]["roofline_fraction_per_rep"]), _tp_of(hp[0].get("engine"), tp),
                 shape=hyb.get("shape"), context=hp[0]["context"], kv_dtype=hyb.get("kv_dtype"), floor_ms=hp[0]["floor_ms"])
    else:
        keys.miss(name, keys.missing("hybrid"), hyb.get("note"), "no decode point with a roofline")
    if hyb.get("hybrid_192k_ok") is not None:
        inputs = hyb.get("hybrid_192k_ok_inputs", {})
        keys.flag("hybrid_192k_ok", hyb["hybrid_192k_ok"], inputs.get("tensor_parallel_size", tp), inputs)
    else:
        keys.miss("hybrid_192k_ok", keys.missing("hybrid"), hyb.get("hybrid_192k_ok_reason"))
    one = hyb.get("one_gpu") or {}
    if one.get("hybrid_one_gpu_192k_ok") is not None:
        keys.flag("hybrid_one_gpu_192k_ok", one["hybrid_one_gpu_192k_ok"], 1, one.get("hybrid_one_gpu_192k_ok_inputs"))
    else:
        keys.miss("hybrid_one_gpu_192k_ok", keys.missing("hybrid"), one.get("hybrid_one_gpu_192k_ok_reason"),
                  one.get("reason"))


MOE_SHAPE = "qwen3-30b-a3b"          # the shape the moe keys name


def _moe(keys: Keys, results: dict, ref: dict) -> None:
    sec = keys.secs.get("moe", {})
    if sec.get("shape") not in (None, MOE_SHAPE):
        for name in ("moe_30b_a3b_decode_b1_roofline_fraction", "moe_30b_a3b_tp2_over_tp1_decode_b1"):
            keys.miss(name, f"the moe section ran the {sec['shape']} shape, not {MOE_SHAPE}")
        return
    one = [p for p in _measured(sec.get("points", [])) if p.get("label") == "tp1"]
    name = "moe_30b_a3b_decode_b1_roofline_fraction"
    if one and one[0].get("roofline_fraction_per_rep"):
        cfg = shapes.model_config(one[0]["shape"])
        keys.put(name, interleave.reduce_values(one[0]["roofline_fraction_per_rep"]), 1, shape=one[0]["shape"],
                 context=one[0]["context"], floor_ms=one[0]["floor_ms"],
                 active_weight_bytes=shapes.weight_bytes_per_step(cfg))
    else:
        keys.miss(name, keys.missing("moe"), "no TP1 decode point with a roofline")
    pair = (sec.get("pairs") or {}).get("decode_b1") or {}
    name = "moe_30b_a3b_tp2_over_tp1_decode_b1"
    if "tp2" in pair.get("sides", []):
        keys.put(name, interleave.reduce_pair(pair, "tp2", "tp1", "decode_tok_s"), pair.get("tensor_parallel_size"),
                 shape=pair.get("shape"), context=pair.get("context"))
    else:
        keys.miss(name, keys.missing("moe"), sec.get("tp2_reason"))
