"""Writing a run: results.json (every figure with its parameters), summary.md (the seed-style tables
and the headline against its targets, tools/bench/targets.py), PNG plots, and the compact table printed last."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tools.bench import interleave
from tools.bench.derive import TARGETS
from tools.bench.progress import fmt, si

K = 1024


def _clean(x):
    """JSON-safe: no NaN/inf (written as null)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write(results: dict, out: Path, summary: bool = True, plots: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(_clean(results), indent=1, sort_keys=False))
    tmp.replace(out / "results.json")
    if summary:
        (out / "summary.md").write_text(markdown(results))
    if plots:
        try:
            from tools.bench import plots as plotting
            plotting.write_all(results, out)
        except Exception as e:  # noqa: BLE001 - plots are a convenience; the JSON is the record
            results.setdefault("warnings", []).append(f"plots not written: {e!r}")


# -- helpers -------------------------------------------------------------------------------------

def _measured(points):
    return [p for p in points or [] if "skipped" not in p and "error" not in p]


def _ctx(n: int) -> str:
    return f"{n // K}k" if n >= K and n % K == 0 else str(n)


def _tab(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines + [""]


def _target_text(name: str) -> str:
    op, target, _ = TARGETS[name]
    if op is None:
        return "—"
    if isinstance(target, bool):
        return "yes" if target else "no"
    return f"{op} {target:g}"


def _skips(points, key_fn) -> list[str]:
    return [f"- {key_fn(p)}: {p.get('skipped') or p.get('error')}" for p in points or []
            if "skipped" in p or "error" in p]


# -- summary.md ----------------------------------------------------------------------------------

def markdown(r: dict) -> str:
    run, secs = r["run"], r.get("sections", {})
    dev = run["device"]
    git = run.get("git", {})
    v = run.get("versions", {})
    L = [f"# ninfer benchmark — {run['shape']} on {dev['name']} ({run['mode']})", "",
         f"- date {run['date']}, commit {(git.get('commit') or 'unknown')[:12]}{' (dirty)' if git.get('dirty') else ''}, "
         f"run id {run['run_id']}",
         f"- torch {v.get('torch')}, triton {v.get('triton')}, transformers {v.get('transformers')}, "
         f"python {v.get('python')}; {dev.get('count', 0)} GPU(s)",
         f"- command: `{run.get('command', '')}`",
         "- rates come from each request's own phase timings (prefill_tok_s = computed_prefill_tokens / "
         "timings.prefill; decode_tok_s = (completion_tokens - 1) / timings.decode); every prompt is fresh "
         "random tokens (no prefix-cache hits); decode runs with ignore_eos; the sweeps' tables show the peak "
         "(max over repeats) and the median.",
         f"- headline: {r.get('headline_basis', '')}.", ""]
    merged = [rid for rid in r.get("runs", {}) if rid != run["run_id"]]
    if merged:
        L += [f"- sections merged from earlier runs: {', '.join(merged)}", ""]

    L += ["## Headline (targets: tools/bench/targets.py)", ""]
    rows = []
    for name, d in r.get("headline_detail", {}).items():
        val = d["value"]
        tp = f"TP{d.get('tensor_parallel_size')}" + (f"/TP{d['baseline_tensor_parallel_size']}"
                                                      if d.get("baseline_tensor_parallel_size") else "")
        reps = f"{len(d['per_rep'])} reps; " if isinstance(d.get("per_rep"), list) and val is not None else ""
        rows.append([f"`{name}`", fmt(val), _target_text(name), fmt(d.get("ratio_to_target")),
                     "—" if d.get("met") is None else ("**yes**" if d["met"] else "no"),
                     f"{tp}; " + (d.get("reason") or reps + _inputs_text(d.get("inputs"))), d["target_text"]])
    L += _tab(["figure", "measured", "target", "ratio to target", "met", "conditions / reason", "target text"], rows)

    L += _limits(r) + _peer(r) + _prefill(r) + _decode(r) + _acceptance(r) + _concurrency(r) + _kv(r) + _tp(r) + _e2e(r)
    L += _quant(r) + _hybrid(r) + _moe(r) + _pd(r)

    L += ["## Sections", ""]
    rows = [[name, s.get("status", "?"), fmt(s.get("elapsed_s")), s.get("run_id", ""),
             (s.get("reason") or s.get("error") or "")[:200]] for name, s in secs.items()]
    L += _tab(["section", "status", "seconds", "run", "reason / error"], rows)
    for w in r.get("warnings", []):
        L.append(f"- warning: {w}")
    return "\n".join(L) + "\n"


def _inputs_text(inputs: dict | None) -> str:
    if not inputs:
        return ""
    parts = []
    for k, v in inputs.items():
        if isinstance(v, float):
            parts.append(f"{k} {fmt(v)}")
        elif isinstance(v, dict):
            parts.append(f"{k} " + ", ".join(f"{a}: {fmt(b)}" for a, b in v.items()))
        else:
            parts.append(f"{k} {v}")
    return "; ".join(parts)[:300]


def _limits(r: dict) -> list[str]:
    sec = r["sections"].get("roofline")
    if not sec or "copy" not in sec:
        return []
    L = ["## Limits measured in this run", ""]
    c, m, g = sec.get("copy", {}), sec.get("matmul", {}), sec.get("gemv", {})
    L.append(f"- copy bandwidth (read + write, {c.get('buffer_bytes', 0) / 2**30:.1f} GiB buffer): "
             f"**{si(c.get('bandwidth_Bps'), 'B/s')}** median of {c.get('repeats')}")
    if m:
        L.append(f"- matmul {m['n']}^3 {m['dtype']} on random data: **{si(m['flops_per_s'], 'FLOP/s')}** "
                 f"median of {m['repeats']}")
    if g:
        L.append(f"- GEMV {g['shape']} bf16 (batch-1 lm_head shape): {si(g['bandwidth_Bps'], 'B/s')}")
    floor = [p for p in _measured(r["sections"].get("decode", {}).get("points")) if p.get("floor_ms")]
    for p in floor[:1]:
        L.append(f"- decode floor of {r['run']['shape']} at context {p['context']} (+ half the output): "
                 f"{p['floor_ms']:.2f} ms/token = {1e3 / p['floor_ms']:,.0f} tok/s")
    return L + [""]


def _peer(r: dict) -> list[str]:
    sec = r["sections"].get("peer")
    if not sec or "setup" not in sec:
        return []
    s = sec["setup"]
    L = [f"## Peer: transformers {s['transformers']} ({s['attn_implementation']}, {s['dtype']}, random weights)", ""]
    pairs = {p["P"]: p for p in sec.get("prefill_pairs", [])}
    rows = [[str(p["P"]), fmt(p["tok_s_peak"]), fmt(p["tok_s_median"]), fmt(p.get("mfu_median")),
             fmt(interleave.reduce_pair(pairs.get(p["P"]), "engine", "transformers", "prefill_tok_s",
                                        metric_b="tok_s", minimum=1)["value"])]
            for p in _measured(sec.get("prefill"))]
    L += _tab(["P", "transformers tok/s peak", "median", "MFU (median)", "engine / transformers (median per rep)"], rows)
    d = sec.get("decode") or {}
    if "tok_s" in d:
        L.append(f"- decode, `generate()` batch 1 ({s['decode']}), prompt {d['prompt_tokens']}, {d['new_tokens']} "
                 f"new tokens: **{d['tok_s']:.1f} tok/s** ({d['ms_per_token']:.1f} ms/token)")
    elif d:
        L.append(f"- decode: {d.get('skipped') or d.get('error')}")
    c = sec.get("compiled_decode") or {}
    if "ms_per_token_median" in c:
        how = (f"torch.compile(fullgraph, mode={c['mode']}), coordinate-descent tuning, {c['cuda_graph']}"
               if c["compiled"] else c.get("note"))
        r_ = interleave.reduce_pair(sec.get("compiled_decode_pair"), "compiled_peer", "engine", "ms_per_token", minimum=1)
        L.append(f"- decode, the Qwen3 step in plain PyTorch run as gpt-fast runs it ({how}), batch 1 at context "
                 f"{c['context']}: **{c['ms_per_token_median']:.2f} ms/token** (median of {len(c['ms_per_token'])}, "
                 f"interleaved with the engine: engine over it {fmt(r_['value'])}); setup {fmt(c.get('setup_s'))} s")
    elif c:
        L.append(f"- decode, the compiled step: {c.get('error') or c.get('skipped')}")
    L += _skips(sec.get("prefill"), lambda p: f"prefill P={p['P']}")
    return L + [""]


def _prefill(r: dict) -> list[str]:
    sec = r["sections"].get("prefill")
    if not sec:
        return []
    pts = _measured(sec.get("points"))
    peer = {p["P"]: p for p in _measured(r["sections"].get("peer", {}).get("prefill"))}
    chunks = sorted({p["chunk"] for p in sec.get("points", [])})
    Ps = sorted({p["P"] for p in sec.get("points", [])})
    by = {(p["P"], p["chunk"]): p for p in pts}
    L = ["## Prefill tok/s — P × chunk", "",
         "Cell: peak (median) · MFU · relative to the reference P at the same chunk. k = 0 engines.", ""]
    rows = []
    for P in Ps:
        row = [f"{P:,}"]
        for c in chunks:
            p = by.get((P, c))
            if p is None:
                row.append("—")
                continue
            cell = f"{p['prefill_tok_s_peak']:,.0f} ({p['prefill_tok_s_median']:,.0f})"
            if p.get("mfu_peak") is not None:
                cell += f" · MFU {p['mfu_peak']:.2f}"
            if p.get("relative_to_ref_P") is not None:
                cell += f" · ×{p['relative_to_ref_P']:.2f}"
            row.append(cell)
        row.append(f"{peer[P]['tok_s_peak']:,.0f}" if P in peer else "—")
        rows.append(row)
    L += _tab(["P"] + [f"chunk {c}" for c in chunks] + ["transformers"], rows)
    L += _skips(sec.get("points"), lambda p: f"P={p['P']} chunk={p['chunk']}")
    return L + [""]


def _decode(r: dict) -> list[str]:
    sec = r["sections"].get("decode")
    if not sec:
        return []
    pts = _measured(sec.get("points"))
    ctxs = sorted({p["context"] for p in sec.get("points", [])})
    variants = sorted({(p["draft_tokens"], p.get("draft_vocab", 0)) for p in sec.get("points", [])})
    by = {(p["draft_tokens"], p.get("draft_vocab", 0), p["context"]): p for p in pts}
    L = [f"## Decode batch 1 — k × context ({r['run']['shape']}, random weights)", "",
         "Cell: decode tok/s (median) · ms per round (median) · roofline fraction (k = 0, median of the reps). "
         "Acceptance per position "
         "is as measured on random weights (≈0: these rows are the cost of a round; the acceptance "
         "section gives what a workload gets).", ""]
    rows = []
    for k, dv in variants:
        row = [str(k), str(dv) if dv else "full"]
        acc = ""
        for c in ctxs:
            p = by.get((k, dv, c))
            if p is None:
                row.append("—")
                continue
            cell = f"{p['decode_tok_s_median']:,.1f} · {p['ms_per_round_median']:.2f} ms"
            if p.get("roofline_fraction") is not None:
                cell += f" · {p['roofline_fraction']:.2f}"
            row.append(cell)
            acc = acc or "/".join(f"{a:.2f}" for a in p["acceptance_per_position"])
        rows.append(row + [acc or "—"])
    L += _tab(["k", "draft vocab"] + [f"ctx {_ctx(c)}" for c in ctxs] + ["acceptance / position"], rows)
    d = r.get("headline_detail", {}).get("extra_draft_cost_fraction", {})
    if d.get("value") is not None:
        L.append(f"- extra draft cost: {d['value']:.3f} of a k=0 step per draft token "
                 f"(mean over k ≥ 1 of the median per-rep (ms(k) − ms(0)) / (k · ms(0)), each k interleaved with k = 0; "
                 f"target ≤ 0.05); options: " + ", ".join(f"{o} {fmt(c)}" for o, c in (d.get('inputs') or {}).get('options', {}).items()))
    L += _skips(sec.get("points"), lambda p: f"k={p.get('draft_tokens')} ctx={p.get('context')}")
    return L + [""]


def _acceptance(r: dict) -> list[str]:
    sec = r["sections"].get("acceptance")
    if not sec:
        return []
    if sec.get("status") == "skipped":
        return ["## Acceptance", "", f"- skipped: {sec.get('reason')}", ""]
    res = [e for e in sec.get("results", []) if "skipped" not in e]
    ref = sec.get("training_reference", {})
    L = [f"## Acceptance per position — {Path(sec.get('model', '')).name}, and the decode rate it implies on "
         f"{r['run']['shape']}", "",
         f"Acceptance = accepted_per_position[i] / rounds, pooled over the workload's prompts. Implied tok/s = "
         f"(1 + Σ acceptance) / ms_per_round(k) of the decode sweep at context {sec.get('implied_context')}.", ""]
    rows = []
    for e in sorted(res, key=lambda e: (list(ref).index(e["workload"]) if e["workload"] in ref else 9,
                                         e["workload"], e["temperature"], e["k"])):
        tr = ref.get({"enumeration": "enum"}.get(e["workload"], e["workload"]))
        rows.append([e["workload"], f"{e['temperature']:g}", str(e["k"]),
                     " / ".join(f"{a:.2f}" for a in e["acceptance_per_position"]),
                     f"{e['tokens_per_round']:.2f}", fmt(e.get("implied_decode_tok_s")),
                     " / ".join(f"{a:.2f}" for a in tr) if tr and e["k"] == 3 and e["temperature"] == 0 else ""])
    L += _tab(["workload", "T", "k", "acceptance per position", "tokens / round",
               f"implied tok/s ({r['run']['shape']})", "training (k=3, greedy)"], rows)
    if sec.get("k0_decode_tok_s"):
        L.append(f"- k = 0 on {r['run']['shape']}: {sec['k0_decode_tok_s']:,.1f} tok/s for every workload")
    return L + [""]


def _concurrency(r: dict) -> list[str]:
    sec = r["sections"].get("concurrency")
    if not sec:
        return []
    s = sec.get("setup", {})
    L = [f"## Concurrency — N streams decoding together (k = 0, context {s.get('context')}, "
         f"{s.get('max_tokens')} tokens each)", ""]
    rows = [[str(p["streams"]), fmt(p["per_stream_tok_s_mean"]), fmt(p["aggregate_tok_s"]),
             fmt(p.get("aggregate_over_single")), fmt(p.get("wall_aggregate_tok_s"))]
            for p in _measured(sec.get("points"))]
    L += _tab(["N", "per stream tok/s", "aggregate tok/s", "× one stream", "wall-clock aggregate"], rows)
    b = sec.get("ttft_burst") or {}
    if b.get("over_single") is not None:
        L.append(f"- TTFT of {b['streams']} prompts of {b['prompt']} tokens sent together (chunk {b['prefill_chunk']}): "
                 f"median **{b['burst_ttft_s_median'] * 1e3:.1f} ms** (longest {b['burst_ttft_s_max'] * 1e3:.1f} ms) "
                 f"against {b['single_ttft_s_median'] * 1e3:.1f} ms alone → **{b['over_single']:.2f}×**")
    elif b:
        L.append(f"- TTFT burst: {b.get('skipped') or b.get('error')}")
    i = sec.get("prefill_interference") or {}
    if "max_gap_ms" in i:
        waits = (f"the stream waited {i['chunk_gaps']} times for {i['chunks']} chunks → "
                 f"{'one chunk per wait' if i['ok'] else 'STALLED over more than one chunk'}; "
                 if "chunk_gaps" in i else f"{'ok' if i['ok'] else 'not ok'} by the older longest-gap rule; ")
        L.append(f"- a P={i['long_prompt']:,} prompt (chunk {i['chunk']}) prefilled while a stream decoded: {waits}"
                 f"longest gap between the stream's tokens **{i['max_gap_ms']:.1f} ms** (the last chunks attend "
                 f"to the most context); mean chunk {i['chunk_ms']:.1f} ms, one decode step "
                 f"{i['baseline_gap_ms']:.1f} ms"
                 f"{'' if i['stream_outlived_prefill'] else ' (the stream ended before the prefill did)'}")
    elif i:
        L.append(f"- prefill interference: {i.get('skipped') or i.get('error')}")
    L += _skips(sec.get("points"), lambda p: f"N={p.get('streams')}")
    return L + [""]


def _kv(r: dict) -> list[str]:
    sec = r["sections"].get("kv")
    if not sec or not sec.get("ratios"):
        return [] if not sec else ["## KV dtype", "", f"- {sec.get('int8_over_bf16_reason') or sec.get('error')}", ""]
    L = ["## KV dtype — decode batch 1, k = 0, the two engines interleaved", ""]
    base = sec["ratios"][0]["base_kv_dtype"]
    by = {(p.get("kv_dtype"), p["context"]): p for p in _measured(sec.get("points"))}
    rows = [[_ctx(x["context"]), fmt((by.get((base, x["context"])) or {}).get("decode_tok_s_median")),
             fmt((by.get(("int8", x["context"])) or {}).get("decode_tok_s_median")), fmt(x["ratio"]),
             f"{x['bytes_ratio']:.3f}"] for x in sec["ratios"]]
    L += _tab(["context", f"{base} tok/s (median)", "int8 tok/s (median)", f"int8 / {base} (median per rep)",
               "bytes bound"], rows)
    return L


def _tp(r: dict) -> list[str]:
    sec = r["sections"].get("tp")
    if not sec:
        return []
    if sec.get("status") == "skipped":
        return ["## Tensor parallel", "", f"- skipped: {sec.get('reason')}", ""]
    L = ["## Tensor parallel — decode batch 1, k = 0", ""]
    rows = [[p.get("label", ""), p.get("shape", ""), str(p["engine"].get("tensor_parallel_size")),
             p["engine"].get("kv_dtype", ""), str(p["context"]), fmt(p["decode_tok_s_median"]),
             f"{p['ms_per_round_median']:.2f}", fmt(p.get("roofline_fraction"))]
            for p in _measured(sec.get("points"))]
    L += _tab(["run", "shape", "TP", "KV", "context", "tok/s (median)", "ms/token (median)", "roofline fraction"], rows)
    pairs = {n: p for n, p in (sec.get("pairs") or {}).items() if "sides" in p}
    if pairs:
        L += ["", "TP1 and TP2 interleaved (medians of the reps; ratio: median of the per-rep ratios):", ""]
        rows = []
        for name, pair in pairs.items():
            metric = {"decode_b1": "decode_tok_s", "streams": "aggregate_tok_s"}.get(name, "prefill_tok_s")
            med = {s: interleave.reduce_values(interleave.values(pair, s, metric), minimum=1)["value"] for s in ("tp1", "tp2")}
            rows.append([name, fmt(med["tp1"]), fmt(med["tp2"]),
                         fmt(interleave.reduce_pair(pair, "tp2", "tp1", metric, minimum=1)["value"]),
                         str(len(pair["reps"]["tp1"]))])
        L += _tab(["figure", "TP1", "TP2", "TP2 / TP1", "reps"], rows)
    k = sec.get("kernels_per_round")
    if k:
        L.append("- kernels per decode round: " + "; ".join(f"{e}: " + ", ".join(f"{d} {n:.0f}" for d, n in v.items())
                                                           for e, v in k.items()))
    L += _long_context_line("long context", sec.get("long_context"), sec.get("context_192k_ok"))
    return L + [""]


def _long_context_line(label: str, lc: dict | None, ok: bool | None) -> list[str]:
    if not lc:
        return []
    return [f"- {label}: {lc.get('context', lc.get('prompt_tokens'))} tokens → {'ok' if ok else 'FAILED'} "
            f"{lc.get('error', '')}(prefill {fmt(lc.get('prefill_tok_s'))} tok/s, decode {fmt(lc.get('decode_tok_s'))} tok/s)"]


def _hybrid(r: dict) -> list[str]:
    sec = r["sections"].get("hybrid")
    if not sec or sec.get("status") == "skipped":
        return ["## Hybrid (Qwen3.5 class)", "", f"- skipped: {sec.get('reason')}", ""] if sec else []
    st = sec.get("state_bytes_per_request_per_rank")
    L = [f"## Hybrid (Qwen3.5 class) — {sec.get('shape')}, TP={sec.get('tensor_parallel_size')}, "
         f"{sec.get('kv_dtype')} KV, k = 0", ""]
    if st:
        L.append(f"- linear-attention state per request per rank: {st / 1e6:.1f} MB (float32)")
    rows = [[str(p["context"]), fmt(p["decode_tok_s_median"]), f"{p['ms_per_round_median']:.2f}", fmt(p.get("floor_ms")),
             fmt(p.get("roofline_fraction"))] for p in _measured(sec.get("points"))]
    L += [""] + _tab(["context", "decode tok/s", "ms/token", "floor ms", "roofline fraction"], rows)
    pre = [p for p in sec.get("prefill", []) if "prefill_tok_s" in p]
    if pre:
        L += [""] + _tab(["prefill P", "chunk", "tok/s", "MFU per GPU"],
                         [[str(p["P"]), str(p["chunk"]), fmt(p["prefill_tok_s"]), fmt(p.get("mfu_per_gpu"))] for p in pre])
    L += _long_context_line("long context", sec.get("long_context"), sec.get("hybrid_192k_ok"))
    one = sec.get("one_gpu") or {}
    p = one.get("point")
    if p:
        L.append(f"- one GPU, {one.get('model')}: decode ctx {p['context']} {fmt(p['decode_tok_s_median'])} tok/s, "
                 f"{p['ms_per_round_median']:.2f} ms (floor {fmt(p.get('floor_ms'))} ms, "
                 f"{fmt(p.get('roofline_fraction'))} of roofline, {one['bytes_per_step'] / 1e9:.2f} GB per step)")
    L += _long_context_line("one GPU long context", one.get("long_context"), one.get("hybrid_one_gpu_192k_ok"))
    return L + [""]


def _e2e(r: dict) -> list[str]:
    sec = r["sections"].get("e2e")
    if not sec or sec.get("status") == "skipped":
        return ["## End to end", "", f"- skipped: {sec.get('reason')}", ""] if sec else []
    L = ["## End to end — `ninfer engine` + `ninfer gateway` processes over gRPC vs the in-process engine", "",
         "Both up together, taking turns (served, in-process, ...). Client-side timings on both paths: TTFT of "
         "prompts alone (added: median of the paired differences); decode = (tokens - 1) / (last - first token) "
         "per stream, summed over the streams sent together (ratios: median of the per-round ratios).", ""]
    rows = []
    for c in sec.get("configs", []):
        if "skipped" in c or "ttft" not in c:
            rows.append([c.get("label", f"tp{c.get('tp')}"), "skipped: " + str(c.get("skipped"))] + [""] * 4)
            continue
        med = c.get("ttft_ms_median", {})
        ratios = "; ".join(f"{n}: {fmt(c.get(f'agg_{n}_over_inproc'))}" for n in sorted(map(int, c["streams"])))
        rows.append([c["label"], f"{fmt(med.get('inproc'))} / {fmt(med.get('served'))}",
                     f"{fmt(c.get('ttft_added_ms'))} ({c['ttft'].get('reps_paired')} pairs)", ratios,
                     f"{c['consistency_violation_count']} of {c['messages_checked']}",
                     "graphs" if (c.get("served_engine_warmup") or {}).get("cuda_graphs") else
                     (c.get("served_engine_warmup") or {}).get("no_graphs_reason") or "?"])
    L += _tab(["config", "TTFT ms in-proc / served (medians)", "added ms", "served / in-process by streams",
               "inconsistent final messages", "served engine"], rows)
    bad = [v for c in sec.get("configs", []) for v in c.get("consistency_violations", [])[:5]]
    if bad:
        L += ["", "First inconsistencies:", ""] + [f"- {v}" for v in bad[:10]]
    return L + [""]


def _pd(r: dict) -> list[str]:
    sec = r["sections"].get("pd")
    if not sec or sec.get("status") == "skipped":
        return ["## Prefill/decode across engines", "", f"- skipped: {sec.get('reason')}", ""] if sec else []
    L = ["## Prefill/decode across engines — a producer + consumer pair (NIXL) vs one engine, both through smg", "",
         f"{sec.get('model')}, about {sec.get('prompt_tokens_about')} prompt tokens, {sec.get('decode_tokens')} out, "
         "streamed; the two routers take turns. Client-side medians per round; PD / single: the median of the "
         "per-round ratios.", ""]
    rows = []
    for n, rec in sorted((sec.get("streams") or {}).items(), key=lambda kv: int(kv[0])):
        med = {(side, key): interleave.reduce_values(interleave.values(rec, side, key), minimum=1)["value"]
               for side in ("single", "pd") for key in ("ttft_ms_median", "inter_token_ms_median")}
        rows.append([n, f"{fmt(med['single', 'ttft_ms_median'])} / {fmt(med['pd', 'ttft_ms_median'])}",
                     fmt(rec.get("ttft_pd_over_single")),
                     f"{fmt(med['single', 'inter_token_ms_median'])} / {fmt(med['pd', 'inter_token_ms_median'])}",
                     fmt(rec.get("inter_token_pd_over_single")), str(len(rec.get("order", [])) // 2)])
    L += _tab(["streams", "TTFT ms single / PD", "PD / single", "inter-token ms single / PD", "PD / single",
               "rounds"], rows)
    t = sec.get("transfer") or {}
    if t.get("pulls"):
        L += ["", f"- KV moved per prompt: {t['blocks_median']:g} blocks, {t['bytes_median'] / 1e6:.2f} MB in "
                  f"{t['ms_median']:.2f} ms median (p90 {t['ms_p90']:.2f} ms), {t['gb_per_s_median']:.3f} GB/s, "
                  f"over {t['pulls']} pulls"]
    return L + [""]


def _quant_rows(sec: dict) -> list[list[str]]:
    rows = []
    pairs = {(p["shape"], p["format"], p["figure"]): p for p in sec.get("pairs", [])}
    for p in sec.get("points", []):
        if "skipped" in p:
            rows.append([p["shape"], p["format"], "skipped: " + p["skipped"][:120], "", "", ""])
            continue
        shape, fmt_ = p["shape"], p["format"]
        cells = []
        for figure, metric in (("decode_b1", "decode_tok_s"), ("decode_b8", "aggregate_tok_s"), ("prefill", "prefill_tok_s")):
            pair = pairs.get((shape, fmt_, figure)) or next((q for (s_, _, f), q in pairs.items() if s_ == shape
                                                             and f == figure), None)
            if pair is None:
                cells.append("—")
                continue
            med = interleave.reduce_values(interleave.values(pair, fmt_, metric), minimum=1)["value"]
            ratio = None if fmt_ == "bf16" else interleave.reduce_pair(pair, fmt_, "bf16", metric, minimum=1)["value"]
            cells.append(fmt(med) + ("" if ratio is None else f" (×{fmt(ratio)})"))
        rows.append([shape, fmt_, *cells, f"{p.get('decode_bytes_per_step', 0) / 1e9:.2f}"])
    return rows


def _quant(r: dict) -> list[str]:
    sec = r["sections"].get("quant")
    seed = (sec or {}).get("seed_one_gpu") or {}
    if not sec or not (sec.get("points") or seed):
        return []
    L = ["## Weight formats — random weights quantized on the device, k = 0, each interleaved with bf16", ""]
    if sec.get("points"):
        L += _tab(["shape", "format", "decode b1 tok/s (× bf16)", "decode b8 aggregate (× bf16)",
                   "prefill tok/s (× bf16)", "GB read per step"], _quant_rows(sec))
    mtp = sec.get("mtp_pair")
    if mtp:
        from tools.bench.raw import rep_ms_per_round
        ms = interleave.reduce_values(interleave.values(mtp, "mtp", rep_ms_per_round), minimum=1)["value"]
        L.append(f"- {mtp['shape']} NVFP4 with k = {mtp['k']} drafts (draft vocabulary {mtp.get('draft_vocab') or 'full'}): "
                 f"{fmt(ms)} ms per round (median), "
                 f"{fmt(interleave.reduce_pair(mtp, 'mtp', 'k0', rep_ms_per_round, minimum=1)['value'])} of a k = 0 step")
    p = seed.get("point")
    if p:
        L.append(f"- the seed's one-GPU deployment, {seed.get('model')} with int8 KV: decode ctx {p['context']} "
                 f"{fmt(p['decode_tok_s_median'])} tok/s, {p['ms_per_round_median']:.2f} ms (floor {fmt(p.get('floor_ms'))} ms, "
                 f"{fmt(p.get('roofline_fraction'))} of roofline, {seed['bytes_per_step'] / 1e9:.2f} GB per step)")
    L += _long_context_line("seed deployment long context", seed.get("long_context"),
                            seed.get("seed_32b_nvfp4_one_gpu_192k_ok"))
    return L + [""]


def _moe(r: dict) -> list[str]:
    sec = r["sections"].get("moe")
    if not sec:
        return []
    if sec.get("status") != "ok":
        return ["## Mixture of experts", "", f"- {sec.get('status')}: {sec.get('reason') or sec.get('error')}", ""]
    L = [f"## Mixture of experts — {sec.get('shape')}, decode batch 1, k = 0", "",
         f"- {(sec.get('describe') or {}).get('experts')} experts, {(sec.get('describe') or {}).get('experts_per_token')} "
         f"per token; bytes of the weights one step reads (the experts routed to): "
         f"{sec.get('active_weight_bytes_per_step', 0) / 1e9:.2f} GB", ""]
    rows = [[p.get("label", ""), str(p["context"]), fmt(p["decode_tok_s_median"]), f"{p['ms_per_round_median']:.3f}",
             fmt(p.get("floor_ms")), fmt(p.get("roofline_fraction"))] for p in _measured(sec.get("points"))]
    L += _tab(["run", "context", "tok/s (median)", "ms/token (median)", "floor ms", "roofline fraction"], rows)
    if sec.get("tp2_reason"):
        L.append(f"- TP2: {sec['tp2_reason']}")
    return L + [""]


# -- the table printed last ----------------------------------------------------------------------

def final_table(r: dict, out: Path | None = None) -> str:
    run, secs = r["run"], r.get("sections", {})
    L = [f"== ninfer bench: {run['shape']} on {run['device']['name']} ({run['mode']}), "
         f"commit {(run.get('git', {}).get('commit') or '?')[:8]}, {run['date']} =="]
    rf = secs.get("roofline", {})
    if "copy" in rf:
        m = rf.get("matmul", {}).get("flops_per_s")
        L.append(f"limits: copy {si(rf['copy']['bandwidth_Bps'], 'B/s')}" + (f", matmul {si(m, 'FLOP/s')}" if m else ""))
    L.append(f"{'headline':<40}{'measured':>10}  {'target':<8}{'ratio':>7}  met")
    for name, d in r.get("headline_detail", {}).items():
        met = "-" if d.get("met") is None else ("yes" if d["met"] else "NO")
        L.append(f"{name:<40}{fmt(d['value']):>10}  {_target_text(name):<8}{fmt(d.get('ratio_to_target')):>7}  {met}"
                 + ("" if d["value"] is not None else f"  ({(d.get('reason') or '')[:70]})"))
    pre = secs.get("prefill", {})
    pts = _measured(pre.get("points"))
    if pts:
        chunks = sorted({p["chunk"] for p in pts})
        Ps = sorted({p["P"] for p in pts})
        by = {(p["P"], p["chunk"]): p["prefill_tok_s_peak"] for p in pts}
        L.append("prefill tok/s peak   " + "".join(f"{_ctx(P):>9}" for P in Ps))
        for c in chunks:
            L.append(f"  chunk {c:<13}" + "".join(f"{fmt(by.get((P, c))):>9}" for P in Ps))
        peer = {p["P"]: p["tok_s_peak"] for p in _measured(secs.get("peer", {}).get("prefill"))}
        if peer:
            L.append(f"  {'transformers':<19}" + "".join(f"{fmt(peer.get(P)):>9}" for P in Ps))
    dec = _measured(secs.get("decode", {}).get("points"))
    if dec:
        ctxs = sorted({p["context"] for p in dec})
        L.append("decode tok/s | ms/round " + "".join(f"{'ctx ' + _ctx(c):>17}" for c in ctxs))
        for k, dv in sorted({(p["draft_tokens"], p.get("draft_vocab", 0)) for p in dec}):
            by = {p["context"]: p for p in dec if p["draft_tokens"] == k and p.get("draft_vocab", 0) == dv}
            label = f"  k={k}" + (f" dv={dv}" if dv else "")
            L.append(f"{label:<24}" + "".join(
                f"{(fmt(by[c]['decode_tok_s_median']) + ' | ' + format(by[c]['ms_per_round_median'], '.2f')) if c in by else '-':>17}"
                for c in ctxs))
    acc = [e for e in secs.get("acceptance", {}).get("results", []) if "skipped" not in e and e["k"] == 3]
    if acc:
        L.append("acceptance k=3 (per position) -> implied tok/s")
        for e in acc:
            L.append(f"  {e['workload']:<12} T={e['temperature']:<4g} "
                     f"{' / '.join(f'{a:.2f}' for a in e['acceptance_per_position']):<20} "
                     f"-> {fmt(e.get('implied_decode_tok_s'))}")
    conc = _measured(secs.get("concurrency", {}).get("points"))
    if conc:
        L.append("streams aggregate tok/s (x one): " + ", ".join(
            f"N={p['streams']} {fmt(p['aggregate_tok_s'])} (x{fmt(p.get('aggregate_over_single'))})" for p in conc))
    i = secs.get("concurrency", {}).get("prefill_interference") or {}
    if "max_gap_ms" in i:
        L.append(f"prefill mid-decode: {i.get('chunk_gaps', '?')} waits for {i.get('chunks', '?')} chunks, longest gap "
                 f"{i['max_gap_ms']:.1f} ms, mean chunk {i['chunk_ms']:.1f} ms -> {'ok' if i['ok'] else 'STALLED'}")
    for row in _quant_rows(secs.get("quant", {})):
        L.append(f"quant {row[0]} {row[1]:<6} decode b1 {row[2]}, b8 {row[3]}, prefill {row[4]}")
    for p in _measured(secs.get("hybrid", {}).get("points")):
        L.append(f"hybrid {secs['hybrid'].get('shape')} TP={secs['hybrid'].get('tensor_parallel_size')} ctx "
                 f"{_ctx(p['context'])}: {fmt(p['decode_tok_s_median'])} tok/s, {p['ms_per_round_median']:.2f} ms "
                 f"({fmt(p.get('roofline_fraction'))} of roofline)")
    L.append("sections: " + " | ".join(
        f"{n} {s.get('status', '?')} {fmt(s.get('elapsed_s'), 2)}s" for n, s in secs.items()))
    for n, s in secs.items():
        if s.get("status") in ("error", "skipped", "interrupted"):
            L.append(f"  {n}: {(s.get('error') or s.get('reason') or '')[:160]}")
    if out is not None:
        L.append(f"results: {out}")
    return "\n".join(L)
