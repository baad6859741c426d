"""The benchmark tool end to end in its smallest CPU mode, its formulas, and its headline rule.

No timing asserts: the CPU figures are plumbing. What is checked is the contract: every section
recorded (ok / skipped / error with a reason), the headline keys with a reason for every null and
their TP size, every comparison interleaved (A, B, A, B, ... recorded in results.json), the headline
derived from the raw per-rep numbers by the median rule (and never from the best rep), and the files
the device returns.
"""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench import derive, headline, interleave, report, shapes
from tools.bench.__main__ import ORDER, _merge, _narrow_decode, _narrow_other, _narrow_quant, parse, run_order
from tools.bench.targets import TARGETS

REPO = Path(__file__).resolve().parents[2]


def close(a, b, rel=1e-6):
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


# -- formulas (docs/performance.md's worked numbers) -----------------------------------------------

def test_decode_floor_of_qwen3_8b_matches_bench_md():
    cfg = shapes.model_config("qwen3-8b")
    assert shapes.params(cfg) == pytest.approx(8.19e9, rel=2e-3)
    # ~15.1 GB per token read at small context -> ~3.6 ms at 4.25 TB/s -> ~275-280 tok/s
    assert shapes.decode_bytes_per_step(cfg, 0) / 1e9 == pytest.approx(15.1, abs=0.1)
    floor = shapes.decode_floor_ms(cfg, 512, 4.25e12)          # + 75 MB of KV at 512 tokens
    assert floor == pytest.approx(3.6, abs=0.05)


def test_prefill_mfu_by_hand_for_qwen3_8b():
    """Model FLOPs per token = 2 x (params without the embedding table and the lm_head) + attention
    (4 x layers x heads x head_dim x mean causal context); the lm_head once per prompt, for the last
    token's logits. Counted here by hand from the shape's numbers."""
    cfg = shapes.model_config("qwen3-8b")
    h, layers, heads, kv_heads, d, ffn, vocab = 4096, 36, 32, 8, 128, 12288, 151936
    layer = (h * heads * d + 2 * h * kv_heads * d + heads * d * h    # q, k, v, o
             + 3 * h * ffn                                             # gate, up, down
             + 2 * h + 2 * d)                                          # two layer norms, q and k norms
    body = layers * layer + h                                          # + the final norm
    assert body == 6_946_075_648 and shapes.body_params(cfg) == body
    assert shapes.params(cfg) == body + 2 * vocab * h                  # untied: embedding and lm_head
    P = 4096
    per_token = 2 * body + 4 * layers * heads * d * (P + 1) / 2
    flops = P * per_token + 2 * vocab * h                              # the lm_head for the last token only
    assert shapes.prefill_flops(cfg, P) == pytest.approx(flops, rel=1e-12)
    # transformers' 30.7k tok/s at P=4096 against 790 TFLOP/s: MFU 0.587 (2 x all params would say 0.68)
    mfu = flops / P * 30.7e3 / 790e12
    assert shapes.mfu(cfg, P, 30.7e3, 790e12) == pytest.approx(mfu, rel=1e-12) == pytest.approx(0.587, abs=0.001)
    old = (2 * shapes.params(cfg) + 4 * layers * heads * d * (P + 1) / 2) * 30.7e3 / 790e12
    assert old / mfu == pytest.approx(1.16, abs=0.01)                  # the embedding and lm_head inflated it
    # attention adds ~56% of the body's work at 32k relative to 4k
    ratio = shapes.prefill_flops_per_token(cfg, 32768) / shapes.prefill_flops_per_token(cfg, 4096)
    assert ratio == pytest.approx(1.56, abs=0.01)


def test_tied_embeddings_are_one_matrix_to_leave_out():
    cfg = shapes.model_config("tiny")
    assert cfg.tie_word_embeddings
    assert shapes.body_params(cfg) == shapes.params(cfg) - cfg.vocab_size * cfg.hidden_size


def test_int8_kv_bytes_bound_at_32k():
    cfg = shapes.model_config("qwen3-8b")
    bound = shapes.decode_bytes_per_step(cfg, 32768) / shapes.decode_bytes_per_step(cfg, 32768, kv_dtype="int8")
    assert 1.10 < bound <= 1.14
    # TP2 halves what each rank reads
    assert shapes.decode_bytes_per_step(cfg, 512, tp=2) == pytest.approx(shapes.decode_bytes_per_step(cfg, 512) / 2)


def test_extra_draft_cost_formula():
    ms = {0: 24.4, 2: 25.4, 3: 26.6, 5: 32.1}       # the seed's ms per round
    expected = ((25.4 - 24.4) / (2 * 24.4) + (26.6 - 24.4) / (3 * 24.4) + (32.1 - 24.4) / (5 * 24.4)) / 3
    assert close(derive.extra_draft_cost(ms), expected)
    assert derive.extra_draft_cost({1: 10.0}) is None


def test_decode_flags_narrow_the_plan():
    from tools.bench.plan import make_plan
    plan = make_plan("cuda", "qwen3-8b", True, None, 1.0).decode
    _narrow_decode(plan, parse(["--decode-ks", "0", "--decode-draft-vocab-ks", "1,3", "--decode-contexts", "512"]))
    assert plan.ks == [0] and plan.draft_vocab_ks == [1, 3]
    assert plan.contexts[0] == [512] and plan.contexts[1] == [512] and plan.contexts[3] == [512]
    plan = make_plan("cuda", "qwen3-8b", True, None, 1.0).decode
    before = (list(plan.ks), dict(plan.contexts))
    _narrow_decode(plan, parse([]))
    assert (plan.ks, plan.contexts) == before                      # no flag, no change
    _narrow_decode(plan, parse(["--decode-draft-vocab-ks", ""]))
    assert plan.draft_vocab_ks == []


def test_quant_flags_narrow_the_plan():
    from tools.bench.plan import make_plan
    plan = make_plan("cuda", "qwen3-8b", True, None, 1.0).quant
    assert plan.formats == ["bf16", "fp8", "nvfp4", "w4a16", "fp16"] and not plan.decode_only and plan.mtp_k == 3
    _narrow_quant(plan, parse(["--quant-formats", "bf16,fp8", "--quant-decode-only"]))
    assert plan.formats == ["bf16", "fp8"] and plan.decode_only and plan.mtp_k == 3
    _narrow_quant(plan, parse(["--quant-mtp-k", "0"]))
    assert plan.mtp_k == 0
    # --repeats sets the interleaved rounds of every comparison
    repeated = make_plan("cuda", "qwen3-8b", True, 5, 1.0)
    assert (repeated.quant.reps, repeated.peer.reps, repeated.tp.reps, repeated.e2e.reps) == (5, 5, 5, 5)
    assert plan.reps == 3


def test_every_plan_gives_each_headline_comparison_three_reps_and_32_ttft_samples():
    from tools.bench.plan import make_plan
    for device, quick in (("cuda", False), ("cuda", True), ("cpu", True), ("cpu", False)):
        plan = make_plan(device, "qwen3-8b" if device == "cuda" else "tiny", quick)
        ref = plan.reference
        assert min(plan.peer.reps, plan.decode.pair_reps, plan.concurrency.reps, plan.concurrency.burst_repeats,
                   plan.kv.repeats, plan.tp.reps, plan.e2e.reps, plan.quant.reps, plan.hybrid.decode_reps,
                   plan.moe.reps) >= interleave.MIN_REPS, (device, quick)
        assert plan.decode.repeats[ref["decode_context"]] >= 3
        assert plan.prefill.repeats[ref["prefill_P"]] >= 3 and plan.prefill.repeats[ref["prefill_long_P"]] >= 3
        assert plan.e2e.ttft_samples >= headline.E2E_TTFT_MIN_SAMPLES
        assert ref["tp_prefill_P"] in plan.tp.prefill_prompts


def test_peer_and_e2e_flags_narrow_the_plan():
    from tools.bench.plan import make_plan
    plan = make_plan("cuda", "qwen3-8b", True, None, 1.0)
    assert plan.peer.parts == ("transformers", "compiled") and plan.peer.compiled_mode == "max-autotune-no-cudagraphs"
    _narrow_other(plan, parse(["--peer-parts", "compiled", "--peer-compile-mode", "reduce-overhead", "--e2e-tps", "1",
                               "--e2e-ks", "0", "--e2e-streams", "1,8", "--moe-shape", "x"]))
    assert plan.peer.parts == ("compiled",) and plan.peer.compiled_mode == "reduce-overhead"
    assert (plan.e2e.tps, plan.e2e.ks, plan.e2e.streams, plan.moe.shape) == ([1], [0], [1, 8], "x")


def test_sections_run_in_the_benchs_order_unless_asked_in_the_given_one():
    named = ["quant", "e2e", "decode", "peer", "roofline"]
    assert run_order(named, given=False) == ["roofline", "peer", "decode", "e2e", "quant"]
    assert run_order(named, given=True) == ["roofline", "quant", "e2e", "decode", "peer"]    # roofline first
    assert run_order(["e2e", "quant", "e2e"], given=True) == ["e2e", "quant"]
    assert parse(["--in-given-order"]).in_given_order and not parse([]).in_given_order


def test_merge_keeps_sections_not_rerun():
    new = {"runs": {"b": {}}, "sections": {"tp": {"run_id": "b"}}}
    old = {"runs": {"a": {}}, "sections": {"prefill": {"run_id": "a"}, "tp": {"run_id": "a"}}}
    _merge(new, old, running={"tp"})
    assert new["sections"]["prefill"]["run_id"] == "a"
    assert new["sections"]["tp"]["run_id"] == "b"
    assert set(new["runs"]) == {"a", "b"}
    # a measured section replaces a skipped one when reports of two runs are merged
    one_gpu = {"runs": {"a": {}}, "sections": {"tp": {"run_id": "a", "status": "skipped", "reason": "1 GPU"}}}
    _merge(one_gpu, {"runs": {"b": {}}, "sections": {"tp": {"run_id": "b", "status": "ok"}}}, running=set())
    assert one_gpu["sections"]["tp"]["run_id"] == "b"


# -- the headline rule on synthetic raw figures ---------------------------------------------------

def _pair(a: str, xs: list, b: str, ys: list, metric: str, **fields) -> dict:
    """An interleaved record as the sections write it: sides a and b taking turns, one figure per rep."""
    order = [side for _ in xs for side in (a, b)]
    return {"sides": [a, b], "order": order, "reps": {a: [{metric: x} for x in xs], b: [{metric: y} for y in ys]},
            **fields}


def _synthetic(**sections) -> dict:
    from tools.bench.plan import make_plan
    import dataclasses
    plan = dataclasses.asdict(make_plan("cuda", "qwen3-8b", True))
    run = {"shape": "qwen3-8b", "run_id": "r", "roofline": {"bandwidth_Bps": 4.25e12, "flops_per_s": 790e12}}
    results = {"run": run, "runs": {"r": run}, "plan": plan,
               "sections": {name: {"run_id": "r", "status": "ok", **sec} for name, sec in sections.items()}}
    derive.annotate(results)
    return results


def test_headline_ratios_are_the_median_of_per_rep_ratios_never_the_best_rep():
    bf16, fp8 = [100.0, 80.0, 120.0], [127.0, 136.0, 132.0]         # per rep 1.27, 1.70, 1.10
    engine_ms, peer_ms = [4.1, 4.3, 4.0], [4.55, 4.5, 4.6]
    r = _synthetic(
        quant={"headline_shape": "qwen3-8b", "points": [],
               "pairs": [_pair("bf16", bf16, "fp8", fp8, "prefill_tok_s", shape="qwen3-8b", format="fp8",
                               figure="prefill", P=4096, tensor_parallel_size=1)]},
        peer={"compiled_decode": {"compiled": True, "mode": "max-autotune-no-cudagraphs"},
              "compiled_decode_pair": _pair("engine", engine_ms, "compiled_peer", peer_ms, "ms_per_token",
                                            context=512, tokens=256, tensor_parallel_size=1)},
        tp={"pairs": {"decode_b1": _pair("tp1", [100.0, 101.0], "tp2", [170.0, 175.0], "decode_tok_s",
                                         tensor_parallel_size={"tp1": 1, "tp2": 2})}})
    h, d = r["headline"], r["headline_detail"]
    assert h["fp8_over_bf16_prefill_4k"] == pytest.approx(1.27)          # best of each side would say 1.13, max ratio 1.70
    assert h["fp8_over_bf16_prefill_4k"] != pytest.approx(statistics.median(fp8) / statistics.median(bf16))
    assert d["fp8_over_bf16_prefill_4k"]["per_rep"] == pytest.approx([1.27, 1.7, 1.1])
    assert d["fp8_over_bf16_prefill_4k"]["rule"] == interleave.RULE_RATIO
    assert h["decode_b1_over_compiled_peer"] == pytest.approx(statistics.median(p / e for p, e in zip(peer_ms, engine_ms)))
    # two reps are not enough for a headline figure: null, with the reason
    assert h["tp2_over_tp1_decode_b1"] is None
    assert "needs 3" in d["tp2_over_tp1_decode_b1"]["reason"]
    assert d["tp2_over_tp1_decode_b1"]["tensor_parallel_size"] == 2
    assert d["tp2_over_tp1_decode_b1"]["baseline_tensor_parallel_size"] == 1


def test_ttft_added_is_the_median_of_at_least_32_paired_differences():
    inproc = [20.0 + (i % 5) for i in range(32)]
    added = [1.5 + 0.1 * ((7 * i) % 11) for i in range(32)]
    served = [a + b for a, b in zip(inproc, added)]
    streams = {"1": _pair("served", [99.0] * 3, "inproc", [100.0] * 3, "aggregate_tok_s", streams=1),
               "8": _pair("served", [760.0, 790.0, 700.0], "inproc", [800.0] * 3, "aggregate_tok_s", streams=8)}
    config = {"label": "tp1-k0", "tensor_parallel_size": 1, "ttft": _pair("served", served, "inproc", inproc, "ttft_ms"),
              "streams": streams}
    r = _synthetic(e2e={"configs": [config]})
    assert r["headline"]["e2e_ttft_added_ms"] == pytest.approx(statistics.median(added))
    assert r["headline_detail"]["e2e_ttft_added_ms"]["rule"] == interleave.RULE_DIFFERENCE
    assert r["headline"]["e2e_decode_b1_over_inproc"] == pytest.approx(0.99)
    assert r["headline"]["e2e_agg_8_over_inproc"] == pytest.approx(0.95)
    short = {**config, "ttft": _pair("served", served[:31], "inproc", inproc[:31], "ttft_ms")}
    r = _synthetic(e2e={"configs": [short]})
    assert r["headline"]["e2e_ttft_added_ms"] is None
    assert "needs 32" in r["headline_detail"]["e2e_ttft_added_ms"]["reason"]


def test_every_key_carries_its_tp_size_and_a_figure_at_another_tp_is_not_the_key():
    hybrid = {"tensor_parallel_size": 1, "note": "1 GPU(s): run at TP=1", "hybrid_192k_ok": True,
              "hybrid_192k_ok_inputs": {"tensor_parallel_size": 1}}
    r = _synthetic(hybrid=hybrid)
    d = r["headline_detail"]
    assert set(d) == set(TARGETS)
    for name, row in d.items():
        assert row["tensor_parallel_size"] in (1, 2), name
        assert row["target_tensor_parallel_size"] == TARGETS[name].tp, name
    assert r["headline"]["hybrid_192k_ok"] is None
    assert "TP=1" in d["hybrid_192k_ok"]["reason"] and "TP=2" in d["hybrid_192k_ok"]["reason"]
    assert d["hybrid_192k_ok"]["tensor_parallel_size"] == 1
    r = _synthetic(hybrid={**hybrid, "tensor_parallel_size": 2, "hybrid_192k_ok_inputs": {"tensor_parallel_size": 2}})
    assert r["headline"]["hybrid_192k_ok"] is True and r["headline_detail"]["hybrid_192k_ok"]["tensor_parallel_size"] == 2


def test_reserved_keys_are_derived_from_their_sections_raw_reps():
    """structured (another section's): overhead = unconstrained / structured - 1 per rep, the median;
    the moonshot: prose tokens per round over each rep's NVFP4 k=3 ms per round."""
    b1 = _pair("unconstrained", [100.0, 100.0, 100.0], "structured", [97.0, 96.0, 99.0], "decode_tok_s")
    rep = {"draft_tokens": 3, "decode_s": 0.3, "completion_tokens": 400}
    mtp = {"sides": ["k0", "mtp"], "order": ["k0", "mtp"] * 3, "k": 3, "shape": "qwen3-8b", "tensor_parallel_size": 1,
           "reps": {"k0": [{"draft_tokens": 0, "decode_s": 0.272, "completion_tokens": 101}] * 3,
                    "mtp": [{**rep, "rounds": n} for n in (100, 96, 104)]}}
    acc = {"results": [{"workload": "prose", "k": 3, "temperature": 0.0, "tokens_per_round": 3.16}]}
    r = _synthetic(structured={"pairs": {"b1": b1}}, quant={"headline_shape": "qwen3-8b", "mtp_pair": mtp},
                   acceptance=acc)
    assert r["headline"]["structured_decode_overhead_b1"] == pytest.approx(100 / 97 - 1)
    assert r["headline"]["structured_decode_overhead_b32"] is None
    # the request-structured branch's section: a mask fill's share of a step, taken on a GPU only
    points = [{"batch": 1, "share": 0.031, "fill_ms_median": 0.13, "step_ms": 4.2, "steps": 80, "device": "cuda"},
              {"batch": 32, "share": 0.4, "fill_ms_median": 2.0, "step_ms": 5.0, "steps": 80, "device": "cpu"}]
    shares = _synthetic(structured={"points": points})
    assert shares["headline"]["structured_decode_overhead_b1"] == 0.031
    assert shares["headline"]["structured_decode_overhead_b32"] is None
    assert "CPU" in shares["headline_detail"]["structured_decode_overhead_b32"]["reason"]
    assert r["headline"]["nvfp4_mtp3_b1_implied_tok_s"] == pytest.approx(3.16 / (0.3 / 100 * 1e3) * 1e3)


def test_interleave_runs_whole_rounds_in_turn_and_stops_between_rounds():
    calls = []

    class Budget:                      # allows the first two rounds only
        def allows(self, s):
            return len(calls) < 4

        def skip_reason(self, s):
            return "out of time"

    rec = interleave.run({"a": lambda: calls.append("a") or {"x": 1.0}, "b": lambda: calls.append("b") or {"x": 2.0}},
                         5, Budget(), 1.0, context=7)
    assert calls == rec["order"] == ["a", "b", "a", "b"] and rec["context"] == 7
    assert interleave.interleaved(rec) and "after 2 of 5 rounds" in rec["stopped"]
    assert not interleave.interleaved({**rec, "order": ["a", "a", "b", "b"]})
    assert interleave.reduce_pair(rec, "b", "a", "x")["reason"]          # two rounds: no headline figure


def test_sweeps_measured_one_after_another_give_no_interleaved_key():
    """A results.json of an older run (P and N measured one after the other, no order) derives no
    prefill_32k_over_4k or agg_decode_N_streams."""
    rep = {"prefill_tok_s": 1000.0, "computed_prefill_tokens": 4096, "cached_tokens": 0}
    points = [{"P": P, "chunk": 4096, "prefill_tok_s_peak": 1e3, "prefill_tok_s_median": 1e3, "repeats": [rep] * 3}
              for P in (4096, 32768)]
    r = _synthetic(prefill={"points": points})
    assert r["headline"]["prefill_32k_over_4k"] is None
    assert "interleaved" in r["headline_detail"]["prefill_32k_over_4k"]["reason"]
    r = _synthetic(prefill={"points": points, "order": {"4096": [4096, 32768] * 3}})
    assert r["headline"]["prefill_32k_over_4k"] == pytest.approx(1.0)


# -- the tool end to end on the CPU ----------------------------------------------------------------

@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run([sys.executable, "-m", "tools.bench", "--device", "cpu", "--quick", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=330)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc, json.loads((out / "results.json").read_text())


def test_run_records_every_section_and_the_environment(cpu_run):
    out, proc, r = cpu_run
    assert r["schema"] == "ninfer-bench/1"
    run = r["run"]
    for key in ("date", "device", "versions", "git", "run_id", "shape", "mode", "switches"):
        assert key in run
    assert set(run["switches"]) >= {"NINFER_PDL", "NINFER_P2P_PUSH_MAX_BYTES"}
    assert {"torch", "triton", "transformers"} <= set(run["versions"])
    assert "commit" in run["git"]
    assert run["shape"] == "tiny" and run["mode"] == "cpu-quick"
    assert list(r["sections"]) == ORDER
    for name, sec in r["sections"].items():
        assert sec["status"] in ("ok", "skipped", "error"), name
        if sec["status"] != "ok":
            assert sec.get("reason") or sec.get("error"), name
    # the sections that need nothing but the CPU must work there
    for name in ("roofline", "peer", "prefill", "concurrency", "decode", "kv", "tp"):
        assert r["sections"][name]["status"] == "ok", (name, r["sections"][name].get("error"))


def test_headline_has_every_figure_or_a_reason_and_its_tp_size(cpu_run):
    _, _, r = cpu_run
    assert set(r["headline"]) == set(derive.TARGETS)
    for name, value in r["headline"].items():
        d = r["headline_detail"][name]
        assert d["value"] == value
        assert d["tensor_parallel_size"] == TARGETS[name].tp, name            # the CPU run measures each at its TP
        if value is None:
            assert d["reason"], name
        elif isinstance(d["per_rep"], list):                                  # a median of >= 3 reps, never one
            assert len(d["per_rep"]) >= interleave.MIN_REPS, name
    for name in ("decode_b1_roofline_fraction", "prefill_4k_vs_transformers", "prefill_4k_mfu",
                 "prefill_32k_over_4k", "prefill_32k_vs_transformers", "extra_draft_cost_fraction",
                 "agg_decode_2_streams", "int8_over_bf16_kv_decode_32k", "tp2_over_tp1_decode_b1",
                 "tp2_over_tp1_agg_8", "tp2_over_tp1_prefill_512", "context_192k_ok", "ttft_8x512_over_single",
                 "e2e_ttft_added_ms", "e2e_decode_b1_over_inproc", "fp8_over_bf16_decode_b1", "nvfp4_over_bf16_decode_b1",
                 "fp16_over_bf16_decode_b1", "fp8_over_bf16_prefill_4k", "hybrid_192k_ok"):
        assert r["headline"][name] is not None, (name, r["headline_detail"][name]["reason"])
    assert r["headline_detail"]["tp2_over_tp1_agg_8"]["baseline_tensor_parallel_size"] == 1


def _records(node, path=""):
    """Every interleaved record anywhere in results.json (a dict with sides, order and reps)."""
    if isinstance(node, dict):
        if {"sides", "order", "reps"} <= set(node):
            yield path, node
        for k, v in node.items():
            yield from _records(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _records(v, f"{path}[{i}]")


def test_every_comparison_ran_interleaved_and_recorded_its_order(cpu_run):
    _, _, r = cpu_run
    records = dict(_records(r["sections"]))
    expected = (".peer.compiled_decode_pair", ".peer.prefill_pairs[1]", ".decode.round_cost_pairs[0]", ".kv.pairs[0]",
                ".tp.pairs.decode_b1", ".tp.pairs.streams", ".tp.pairs.prefill_512", ".e2e.configs[0].ttft",
                ".e2e.configs[0].streams.1", ".quant.pairs[0]", ".quant.mtp_pair")
    assert set(expected) <= set(records), sorted(records)
    for path, rec in records.items():
        assert interleave.interleaved(rec), (path, rec["order"])          # A, B, A, B, ... round by round
        assert all(len(rec["reps"][s]) == len(rec["order"]) // len(rec["sides"]) >= 3 for s in rec["sides"]), path
    # the sweeps that interleave their own points: prefill's P per chunk, concurrency's stream counts, the burst
    ref = r["plan"]["reference"]
    order = r["sections"]["prefill"]["order"][str(ref["prefill_chunk"])]
    assert order == [ref["prefill_P"], ref["prefill_long_P"]] * 3
    assert r["sections"]["concurrency"]["order"] == r["plan"]["concurrency"]["streams"] * 3
    assert r["sections"]["concurrency"]["ttft_burst"]["order"] == ["alone", "burst"] * 3


def test_compiled_peer_runs_its_code_path_on_the_cpu_and_gives_no_figure_there(cpu_run):
    _, _, r = cpu_run
    c = r["sections"]["peer"]["compiled_decode"]
    assert not c["compiled"] and c["mode"] is None and c["static_kv_cache"] and c["context"] == r["plan"]["reference"]["decode_context"]
    assert c["ms_per_token_median"] == statistics.median(c["ms_per_token"]) > 0
    pair = r["sections"]["peer"]["compiled_decode_pair"]
    assert [x["ms_per_token"] for x in pair["reps"]["compiled_peer"]] == c["ms_per_token"]
    assert all(x["completion_tokens"] == pair["tokens"] for x in pair["reps"]["engine"])
    assert r["headline"]["decode_b1_over_compiled_peer"] is None
    assert "CPU dry run" in r["headline_detail"]["decode_b1_over_compiled_peer"]["reason"]


def test_prefill_figures_follow_from_the_request_stats(cpu_run):
    _, _, r = cpu_run
    mm = r["sections"]["roofline"]["matmul"]["flops_per_s"]
    cfg = shapes.model_config("tiny")
    points = [p for p in r["sections"]["prefill"]["points"] if "repeats" in p]
    assert points
    for p in points:
        rates = [x["computed_prefill_tokens"] / x["prefill_s"] for x in p["repeats"]]
        assert close(p["prefill_tok_s_peak"], max(rates), 1e-9) and close(p["prefill_tok_s_median"], statistics.median(rates))
        assert all(x["cached_tokens"] == 0 for x in p["repeats"])           # fresh prompts: no prefix hits
        assert p["P"] == p["prompt_tokens"] and p["engine"]["prefill_chunk"] == p["chunk"]
        assert close(p["mfu_median"], shapes.prefill_flops(cfg, p["P"]) / p["P"] * p["prefill_tok_s_median"] / mm)
    ref = r["plan"]["reference"]
    by = {p["P"]: p for p in points if p["chunk"] == ref["prefill_chunk"]}
    P, P2 = ref["prefill_P"], ref["prefill_long_P"]
    mfu = [shapes.mfu(cfg, P, x["prefill_tok_s"], mm) for x in by[P]["repeats"]]
    assert close(r["headline"]["prefill_4k_mfu"], statistics.median(mfu))
    per_round = [b["prefill_tok_s"] / a["prefill_tok_s"] for a, b in zip(by[P]["repeats"], by[P2]["repeats"])]
    assert close(r["headline"]["prefill_32k_over_4k"], statistics.median(per_round))
    pairs = {p["P"]: p for p in r["sections"]["peer"]["prefill_pairs"]}
    for name, at in (("prefill_4k_vs_transformers", P), ("prefill_32k_vs_transformers", P2)):
        reps = pairs[at]["reps"]
        assert all(x["computed_prefill_tokens"] == at and x["cached_tokens"] == 0 for x in reps["engine"])
        want = statistics.median(e["prefill_tok_s"] / t["tok_s"] for e, t in zip(reps["engine"], reps["transformers"]))
        assert close(r["headline"][name], want)


def test_decode_figures_follow_from_the_request_stats(cpu_run):
    _, _, r = cpu_run
    bw = r["sections"]["roofline"]["copy"]["bandwidth_Bps"]
    cfg = shapes.model_config("tiny")
    dec = r["sections"]["decode"]
    points = [p for p in dec["points"] if "repeats" in p]
    for p in points:
        for x in p["repeats"]:
            assert x["finish_reason"] == "length" and x["completion_tokens"] == p["max_tokens"]   # ignore_eos
            assert close(x["decode_tok_s"], (x["completion_tokens"] - 1) / x["decode_s"], 1e-9)
        k = p["draft_tokens"]
        rounds = [x["rounds"] if k else x["completion_tokens"] - 1 for x in p["repeats"]]
        ms = [x["decode_s"] / n * 1e3 for x, n in zip(p["repeats"], rounds)]
        assert close(p["ms_per_round_median"], statistics.median(ms))
        if k:
            assert len(p["acceptance_per_position"]) == k
            total = sum(x["rounds"] for x in p["repeats"])
            assert close(p["acceptance_per_position"][0], sum(x["accepted_per_position"][0] for x in p["repeats"]) / total)
        else:
            floor = shapes.decode_floor_ms(cfg, p["context"] + p["max_tokens"] / 2, bw, "float32", "float32")
            assert close(p["roofline_fraction"], statistics.median(floor / m for m in ms))
            if p["context"] == r["plan"]["reference"]["decode_context"]:
                assert close(r["headline"]["decode_b1_roofline_fraction"], p["roofline_fraction"])
    # the cost of a draft: each k interleaved with k = 0; per variant the mean over k of the median per-rep
    # cost; the headline keeps the cheaper drafting option (the full vocabulary or the reduced one)
    costs = {}
    for pair in dec["round_cost_pairs"]:
        k0, kk = ([derive.rep_ms_per_round(x) for x in pair["reps"][s]] for s in ("k0", "k"))
        costs.setdefault(pair["draft_vocab"], []).append(statistics.median((b / a - 1) / pair["k"] for a, b in zip(k0, kk)))
    assert set(costs) == {0, r["plan"]["decode"]["draft_vocab"]}                  # the reduced draft vocabulary ran
    assert close(r["headline"]["extra_draft_cost_fraction"], min(sum(c) / len(c) for c in costs.values()))


def test_concurrency_kv_and_tp_ratios(cpu_run):
    _, _, r = cpu_run
    conc = {p["streams"]: p for p in r["sections"]["concurrency"]["points"]}
    for p in conc.values():
        for rep in p["reps"]:
            assert len(rep["per_stream_tok_s"]) == p["streams"] and close(rep["aggregate_tok_s"], sum(rep["per_stream_tok_s"]))
        assert close(p["aggregate_tok_s"], statistics.median(x["aggregate_tok_s"] for x in p["reps"]))
    per_round = [a["aggregate_tok_s"] / b["aggregate_tok_s"] for a, b in zip(conc[2]["reps"], conc[1]["reps"])]
    assert close(r["headline"]["agg_decode_2_streams"], statistics.median(per_round))
    burst = r["sections"]["concurrency"]["ttft_burst"]
    assert len(burst["alone"]) == len(burst["bursts"]) == burst["repeats"] >= 3
    assert all(len(b) == burst["streams"] for b in burst["bursts"])
    assert all(x["completion_tokens"] == 1 and x["prompt_tokens"] == burst["prompt"] for b in burst["bursts"] for x in b)
    per_round = [statistics.median(x["ttft_s"] for x in b) / a["ttft_s"] for a, b in zip(burst["alone"], burst["bursts"])]
    assert close(r["headline"]["ttft_8x512_over_single"], statistics.median(per_round))
    inter = r["sections"]["concurrency"]["prefill_interference"]
    assert {"max_gap_ms", "chunk_ms", "ok", "chunks", "chunk_gaps"} <= set(inter)
    assert inter["ok"] == (inter["stream_outlived_prefill"] and inter["chunk_gaps"] >= inter["chunks"])
    assert inter["chunks"] == -(-inter["long_prompt"] // inter["chunk"])
    kv = r["sections"]["kv"]
    pair = next(p for p in kv["pairs"] if p["context"] == r["plan"]["reference"]["kv_context"])
    assert {x["engine"]["kv_dtype"] for x in kv["points"]} == {"int8", pair["base_kv_dtype"]}
    want = statistics.median(a["decode_tok_s"] / b["decode_tok_s"]
                             for a, b in zip(pair["reps"]["int8"], pair["reps"][pair["base_kv_dtype"]]))
    assert close(r["headline"]["int8_over_bf16_kv_decode_32k"], want)
    tp = r["sections"]["tp"]
    tp1, tp2 = (next(p for p in tp["points"] if p["label"] == lab) for lab in ("tp1", "tp2"))
    assert (tp1["engine"]["tensor_parallel_size"], tp2["engine"]["tensor_parallel_size"]) == (1, 2)
    for name, figure, metric in (("tp2_over_tp1_decode_b1", "decode_b1", "decode_tok_s"),
                                 ("tp2_over_tp1_agg_8", "streams", "aggregate_tok_s"),
                                 ("tp2_over_tp1_prefill_512", "prefill_512", "prefill_tok_s")):
        reps = tp["pairs"][figure]["reps"]
        assert close(r["headline"][name], statistics.median(b[metric] / a[metric] for a, b in zip(reps["tp1"], reps["tp2"])))
    assert all(len(x["per_stream_tok_s"]) == r["plan"]["tp"]["streams"] for x in tp["pairs"]["streams"]["reps"]["tp2"])
    assert set(tp["pairs"]) == {"decode_b1", "streams"} | {f"prefill_{P}" for P in r["plan"]["tp"]["prefill_prompts"]}


def test_e2e_ttft_takes_32_interleaved_samples_per_side(cpu_run):
    _, _, r = cpu_run
    e2e = r["sections"]["e2e"]
    assert e2e["status"] == "ok", e2e.get("error")
    c = next(c for c in e2e["configs"] if c.get("label") == "tp1-k0")
    ttft = c["ttft"]
    assert ttft["order"] == ["served", "inproc"] * 32
    assert len(ttft["reps"]["served"]) == len(ttft["reps"]["inproc"]) == 32
    assert all(x["ttft_ms"] > 0 and x["error"] is None for side in ttft["reps"].values() for x in side)
    assert all(x["gateway_ttft_s"] is not None for x in ttft["reps"]["served"])      # through the gateway
    diffs = [s["ttft_ms"] - i["ttft_ms"] for s, i in zip(ttft["reps"]["served"], ttft["reps"]["inproc"])]
    assert close(r["headline"]["e2e_ttft_added_ms"], statistics.median(diffs))
    one = c["streams"]["1"]["reps"]
    assert close(r["headline"]["e2e_decode_b1_over_inproc"],
                 statistics.median(s["aggregate_tok_s"] / i["aggregate_tok_s"] for s, i in zip(one["served"], one["inproc"])))
    assert c["consistency_violation_count"] == 0, c["consistency_violations"][:5]
    assert c["messages_checked"] == 32 + sum(len(x["records"]) for x in
                                             (rep for pair in c["streams"].values() for rep in pair["reps"]["served"]))


def test_acceptance_implies_decode_rates(cpu_run):
    _, _, r = cpu_run
    acc = r["sections"]["acceptance"]
    if acc["status"] == "skipped":
        pytest.skip(acc["reason"])
    entries = [e for e in acc["results"] if "acceptance_per_position" in e]
    assert {e["workload"] for e in entries} == {"prose", "code", "json", "enumeration"}
    assert {e["temperature"] for e in entries} == {0.0, 0.7}
    for e in entries:
        assert all(close(a, t / e["rounds"]) for a, t in zip(e["acceptance_per_position"], e["accepted_per_position_total"]))
        assert close(e["tokens_per_round"], 1 + sum(e["acceptance_per_position"]))
        assert close(e["implied_decode_tok_s"], e["tokens_per_round"] / e["implied_from_ms_per_round"] * 1e3)


def test_files_are_small_and_the_table_is_printed_last(cpu_run, tmp_path):
    out, proc, r = cpu_run
    files = sorted(p.name for p in out.iterdir())
    assert {"results.json", "summary.md"} <= set(files)
    if importlib.util.find_spec("matplotlib") is not None:      # plots need the bench extra
        assert {"prefill.png", "decode.png"} <= set(files)
    assert len(files) <= 8
    assert sum(p.stat().st_size for p in out.iterdir()) < 2_000_000
    summary = (out / "summary.md").read_text()
    for name in derive.TARGETS:
        assert f"`{name}`" in summary
    assert "## Prefill tok/s" in summary and "## Decode batch 1" in summary
    assert proc.stdout.strip().startswith("== ninfer bench:")
    assert "results:" in proc.stdout.strip().splitlines()[-1]
    # the report rebuilds from the JSON alone
    again = subprocess.run([sys.executable, "-m", "tools.bench", "--report-only", str(out / "results.json"),
                            "--out", str(tmp_path), "--no-plots"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (tmp_path / "summary.md").read_text() == summary


def test_hybrid_section_counts_state_and_full_attention_kv(cpu_run):
    _, _, r = cpu_run
    hyb = r["sections"]["hybrid"]
    assert hyb["status"] == "ok", hyb.get("error")
    cfg = shapes.model_config(hyb["shape"])
    assert cfg.is_hybrid and hyb["tensor_parallel_size"] == 2
    bw, _ = derive.roofline_of(r, hyb["run_id"])
    points = derive._measured(hyb["points"])
    assert [p["context"] for p in points] == r["plan"]["hybrid"]["decode_contexts"]
    for p in points:
        dtype, kv = p["engine"]["dtype"], p["engine"]["kv_dtype"]
        context = p["context"] + p["max_tokens"] / 2
        want = shapes.decode_floor_ms(cfg, context, bw, dtype, kv, 2)
        ms = [x["decode_s"] / (x["completion_tokens"] - 1) * 1e3 for x in p["repeats"]]
        assert close(p["floor_ms"], want) and close(p["roofline_fraction"], statistics.median(want / m for m in ms))
        # only the full-attention layers keep KV; the linear layers' state is read and written once
        kv_layers = len(cfg.full_attention_layers)
        assert kv_layers < cfg.num_hidden_layers
        assert shapes.kv_bytes_per_token(cfg, "bfloat16") == kv_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
        assert shapes.state_bytes_per_step(cfg, 2) == 2 * hyb["state_bytes_per_request_per_rank"] > 0
    first = min(points, key=lambda p: p["context"])
    assert len(first["repeats"]) >= 3
    assert close(r["headline"]["hybrid_27b_tp2_decode_roofline_fraction"], first["roofline_fraction"])
    lc = hyb["long_context"]
    assert r["headline"]["hybrid_192k_ok"] is True
    assert lc["context"] == r["plan"]["hybrid"]["long_context"] and lc["finish_reason"] == "length"
    one = hyb["one_gpu"]
    assert one["model"] == f"preset:{hyb['shape']}-nvfp4" and one["point"]["engine"]["tensor_parallel_size"] == 1
    assert close(one["point"]["roofline_fraction"], one["point"]["floor_ms"] / one["point"]["ms_per_round_median"])
    assert r["headline"]["hybrid_one_gpu_192k_ok"] is True
    assert one["long_context"]["completion_tokens"] == r["plan"]["hybrid"]["long_decode_tokens"]


def test_quant_section_runs_the_seeds_one_gpu_deployment_on_the_dense_shape(cpu_run):
    """The quant section ends with the seed's deployment: the dense shape in NVFP4, int8 KV, one engine
    of one rank, a decode point against its own floor and the long context decoded whole."""
    _, _, r = cpu_run
    quant = r["sections"]["quant"]
    assert quant["status"] == "ok", quant.get("error")
    pairs = {(p["format"], p["figure"]): p for p in quant["pairs"]}
    for (fmt, figure), pair in pairs.items():
        assert pair["sides"] == ["bf16", fmt] and pair["shape"] == quant["headline_shape"]
    for fmt in ("fp8", "nvfp4", "fp16"):
        b8 = pairs[(fmt, "decode_b8")]["reps"][fmt]
        assert all(len(x["per_stream_tok_s"]) == x["streams"] and close(x["aggregate_tok_s"], sum(x["per_stream_tok_s"]))
                   for x in b8)
        engine = next(p["engine"] for p in quant["points"] if p["format"] == fmt)
        assert engine["dtype"] == ("float16" if fmt == "fp16" else "float32")           # fp16: the dtype path
    w4 = next(p for p in quant["points"] if p["format"] == "w4a16")
    if "skipped" in w4:                                                  # a checkout without the INT4 preset
        assert r["headline"]["w4a16_over_bf16_decode_b1"] is None and "w4a16" in r["headline_detail"][
            "w4a16_over_bf16_decode_b1"]["reason"]
    mtp = quant["mtp_pair"]
    assert mtp["k"] == 3 and all(x["draft_tokens"] == 3 for x in mtp["reps"]["mtp"])
    seed = quant["seed_one_gpu"]
    plan = r["plan"]
    assert seed["model"] == f"preset:{plan['quant']['seed_shape']}-nvfp4"
    p = seed["point"]
    assert p["engine"]["tensor_parallel_size"] == 1 and p["engine"]["kv_dtype"] == "int8"
    assert close(p["roofline_fraction"], p["floor_ms"] / p["ms_per_round_median"])
    assert r["headline"]["seed_32b_nvfp4_one_gpu_192k_ok"] is True
    lc = seed["long_context"]
    assert lc["context"] == plan["hybrid"]["long_context"]
    assert lc["completion_tokens"] == plan["hybrid"]["long_decode_tokens"] and lc["finish_reason"] == "length"


def test_structured_section_times_the_mask_fill_against_the_step(cpu_run):
    """The CPU dry run fills JSON-schema masks for batch 1 and 32 along schema-valid walks and times a step of
    the same batch; the headline waits for the GPU run, saying so."""
    _, _, r = cpu_run
    sec = r["sections"]["structured"]
    assert sec["status"] == "ok", sec.get("error") or sec.get("reason")
    points = {p["batch"]: p for p in sec["points"]}
    assert set(points) == {1, 32}
    for b, p in points.items():
        assert p["steps"] > 10 and 0 < p["fill_ms_median"] <= p["fill_ms_p90"] and p["step_ms"] > 0
        assert p["share"] == pytest.approx(p["fill_ms_median"] / p["step_ms"])
        assert p["fill_us_per_request"] == pytest.approx(p["fill_ms_median"] * 1e3 / b)
    assert points[32]["fill_ms_median"] > points[1]["fill_ms_median"]
    for b in (1, 32):
        d = r["headline_detail"][f"structured_decode_overhead_b{b}"]
        assert d["value"] is None and "CPU dry run" in d["reason"]


def test_moe_bytes_count_the_experts_actually_read():
    """Qwen3-30B-A3B: 30.5 B parameters, 3.3 B of them used by a token (its card's "A3B"); a batch-1 decode
    step reads the 8 chosen experts of each of the 48 layers, not 128; a batch reads the union of its choices."""
    cfg = shapes.model_config("qwen3-30b-a3b")
    assert shapes.params(cfg) == pytest.approx(30.5e9, rel=2e-3)
    assert shapes.active_params(cfg) == pytest.approx(3.35e9, rel=2e-3)
    h, v = cfg.hidden_size, cfg.vocab_size
    assert shapes.weight_bytes_per_step(cfg) == (shapes.active_params(cfg) - v * h) * 2
    assert shapes.experts_read(cfg, 1) == pytest.approx(8)
    assert 8 < shapes.experts_read(cfg, 8) < 64 and shapes.experts_read(cfg, 4096) == pytest.approx(128)
    assert shapes.weight_bytes_per_step(cfg, batch=4096) == pytest.approx((shapes.params(cfg) - v * h) * 2, rel=1e-6)
    # prefill MFU counts the active parameters' FLOPs (the body's for every token, the lm_head for the last one)
    assert shapes.body_params(cfg) == shapes.active_params(cfg) - 2 * v * h
    assert shapes.prefill_flops_per_token(cfg, 1) == pytest.approx(2 * shapes.body_params(cfg) + 4 * 48 * 32 * 128
                                                                     + 2 * v * h)
    hybrid = shapes.model_config("qwen3.5-35b-a3b")
    assert shapes.params(hybrid) == pytest.approx(34.66e9, rel=2e-3) and shapes.active_params(hybrid) < 3.5e9


def test_moe_section_and_its_headline_keys(cpu_run):
    """The tiny-moe preset on the CPU: TP1 and TP2 (two in-process ranks) take turns; each point's floor counts
    the experts read; the keys are null at another shape, and at the headline's shape they are the TP1 point's
    median roofline fraction and the median of the per-rep TP2 / TP1 decode rates."""
    _, _, r = cpu_run
    sec = r["sections"]["moe"]
    assert sec["status"] == "ok", sec.get("reason") or sec.get("error")
    pair = sec["pairs"]["decode_b1"]
    assert interleave.interleaved(pair) and pair["sides"] == ["tp1", "tp2"] and len(pair["reps"]["tp1"]) >= 3
    points = {p["label"]: p for p in derive._measured(sec["points"])}
    bw, _ = derive.roofline_of(r, sec["run_id"])
    cfg = shapes.model_config(sec["shape"])
    for label, tp in (("tp1", 1), ("tp2", 2)):
        p = points[label]
        want = shapes.decode_floor_ms(cfg, p["context"] + p["max_tokens"] / 2, bw, p["engine"]["dtype"],
                                      p["engine"]["kv_dtype"], tp)
        assert close(p["floor_ms"], want) and close(p["roofline_fraction"], statistics.median(p["roofline_fraction_per_rep"]))
    for name in ("moe_30b_a3b_decode_b1_roofline_fraction", "moe_30b_a3b_tp2_over_tp1_decode_b1"):
        assert r["headline"][name] is None and r["headline_detail"][name]["reason"], name
    # at the headline's shape (the same records, relabelled) the keys follow the rule
    at_shape = _synthetic(moe={**{k: v for k, v in sec.items() if k != "run_id"}, "shape": "qwen3-30b-a3b",
                               "points": [{**p, "shape": "qwen3-30b-a3b"} for p in points.values()]})
    head = at_shape["headline"]
    one = next(p for p in derive._measured(at_shape["sections"]["moe"]["points"]) if p["label"] == "tp1")
    assert close(head["moe_30b_a3b_decode_b1_roofline_fraction"], statistics.median(one["roofline_fraction_per_rep"]))
    ratios = [a["decode_tok_s"] / b["decode_tok_s"] for a, b in zip(pair["reps"]["tp2"], pair["reps"]["tp1"])]
    assert close(head["moe_30b_a3b_tp2_over_tp1_decode_b1"], statistics.median(ratios))


def test_the_pd_section_derives_per_round_ratios_and_its_gb_per_s_key_on_a_gpu_only():
    """pd: PD / single per stream count is the median of the per-round ratios; pd_kv_transfer_gbps is the
    median of the consumer's pulls, a GPU run's figure (a CPU run's stays in the section, with the reason)."""
    streams = {"8": {**_pair("pd", [300.0, 330.0, 200.0], "single", [100.0, 110.0, 100.0], "ttft_ms_median"),
                     "streams": 8}}
    for rep, gap in zip(streams["8"]["reps"]["pd"] + streams["8"]["reps"]["single"], [50, 60, 40, 100, 100, 100]):
        rep["inter_token_ms_median"] = gap
    pulls = [{"blocks": 4, "bytes": 1000, "seconds": 0.001, "gb_per_s": g} for g in (1.0, 3.0, 2.0)]
    transfer = {"pulls": 3, "blocks_median": 4, "bytes_median": 1000, "ms_median": 1.0, "ms_p90": 1.0,
                "gb_per_s_median": 2.0, "per_pull": pulls}
    r = _synthetic(pd={"streams": streams, "transfer": transfer, "engines": {"device": "cuda"}})
    record = r["sections"]["pd"]["streams"]["8"]
    assert record["ttft_pd_over_single"] == pytest.approx(3.0)       # 3.0, 3.0, 2.0 per round
    assert record["inter_token_pd_over_single"] == pytest.approx(0.5)
    assert r["headline"]["pd_kv_transfer_gbps"] == 2.0
    cpu = _synthetic(pd={"streams": streams, "transfer": transfer, "engines": {"device": "cpu"}})
    assert cpu["headline"]["pd_kv_transfer_gbps"] is None
    assert "CPU run: 2 GB/s" in cpu["headline_detail"]["pd_kv_transfer_gbps"]["reason"]
    table = "\n".join(report._pd(cpu))
    assert "| 8 | 100 / 300 | 3 |" in table and "2.000 GB/s, over 3 pulls" in table, table
