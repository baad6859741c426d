"""The benchmark tool end to end in its smallest CPU mode, and its formulas against docs/performance.md's worked numbers.

No timing asserts: the CPU figures are plumbing. What is checked is the contract: every section
recorded (ok / skipped / error with a reason), the headline keys with a reason for every null, the
derived figures recomputed from the raw per-request numbers, and the files the device returns.
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

from tools.bench import derive, shapes
from tools.bench.__main__ import ORDER, _merge, _narrow_decode, _narrow_quant, parse

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


def test_prefill_mfu_and_attention_share_match_bench_md():
    cfg = shapes.model_config("qwen3-8b")
    # transformers: 30.7k tok/s at P=4096 against 790 TFLOP/s -> MFU ~0.68
    assert shapes.mfu(cfg, 4096, 30.7e3, 790e12) == pytest.approx(0.68, abs=0.01)
    # attention adds ~48% work at 32k relative to 4k
    ratio = shapes.prefill_flops_per_token(cfg, 32768) / shapes.prefill_flops_per_token(cfg, 4096)
    assert ratio == pytest.approx(1.48, abs=0.01)


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
    assert plan.formats == ["bf16", "fp8", "nvfp4"] and not plan.decode_only
    _narrow_quant(plan, parse(["--quant-formats", "bf16,fp8", "--quant-decode-only"]))
    assert plan.formats == ["bf16", "fp8"] and plan.decode_only
    # --repeats also repeats the quant section's prefill and its batch of streams (one of each scatters)
    repeated = make_plan("cuda", "qwen3-8b", True, 5, 1.0).quant
    assert (repeated.prefill_repeats, repeated.batch_repeats) == (5, 5)
    assert (plan.prefill_repeats, plan.batch_repeats) == (2, 1)


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


# -- the tool end to end on the CPU ----------------------------------------------------------------

@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run([sys.executable, "-m", "tools.bench", "--device", "cpu", "--quick", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=280)
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


def test_headline_has_every_figure_or_a_reason(cpu_run):
    _, _, r = cpu_run
    assert set(r["headline"]) == set(derive.TARGETS)
    for name, value in r["headline"].items():
        d = r["headline_detail"][name]
        assert d["value"] == value
        if value is None:
            assert d["reason"], name
    for name in ("decode_b1_roofline_fraction", "prefill_4k_vs_transformers", "prefill_4k_mfu",
                 "prefill_32k_over_4k", "extra_draft_cost_fraction", "agg_decode_2_streams",
                 "int8_over_bf16_kv_decode_32k", "tp2_over_tp1_decode_b1", "context_192k_ok",
                 "ttft_8x512_over_single"):
        assert r["headline"][name] is not None, (name, r["headline_detail"][name]["reason"])


def test_compiled_peer_runs_its_code_path_on_the_cpu_and_gives_no_figure_there(cpu_run):
    _, _, r = cpu_run
    c = r["sections"]["peer"]["compiled_decode"]
    assert not c["compiled"] and c["ms_per_token_best"] == min(c["ms_per_token"]) > 0
    assert c["context"] == r["plan"]["reference"]["decode_context"]
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
        assert close(p["prefill_tok_s_peak"], max(rates), 1e-9)
        assert all(x["cached_tokens"] == 0 for x in p["repeats"])           # fresh prompts: no prefix hits
        assert p["P"] == p["prompt_tokens"] and p["engine"]["prefill_chunk"] == p["chunk"]
        assert close(p["mfu_peak"], shapes.prefill_flops_per_token(cfg, p["P"]) * p["prefill_tok_s_peak"] / mm)
    ref = r["plan"]["reference"]
    by = {p["P"]: p for p in points if p["chunk"] == ref["prefill_chunk"]}
    peer = {p["P"]: p for p in r["sections"]["peer"]["prefill"]}
    assert close(r["headline"]["prefill_4k_vs_transformers"],
                 by[ref["prefill_P"]]["prefill_tok_s_peak"] / peer[ref["prefill_P"]]["tok_s_peak"])
    assert close(r["headline"]["prefill_32k_over_4k"],
                 by[ref["prefill_long_P"]]["prefill_tok_s_peak"] / by[ref["prefill_P"]]["prefill_tok_s_peak"])


def test_decode_figures_follow_from_the_request_stats(cpu_run):
    _, _, r = cpu_run
    bw = r["sections"]["roofline"]["copy"]["bandwidth_Bps"]
    cfg = shapes.model_config("tiny")
    points = [p for p in r["sections"]["decode"]["points"] if "repeats" in p]
    ms = {}
    for p in points:
        for x in p["repeats"]:
            assert x["finish_reason"] == "length" and x["completion_tokens"] == p["max_tokens"]   # ignore_eos
            assert close(x["decode_tok_s"], (x["completion_tokens"] - 1) / x["decode_s"], 1e-9)
        k = p["draft_tokens"]
        rounds = [x["rounds"] if k else x["completion_tokens"] - 1 for x in p["repeats"]]
        assert close(p["ms_per_round_best"], min(x["decode_s"] / n * 1e3 for x, n in zip(p["repeats"], rounds)))
        if k:
            assert len(p["acceptance_per_position"]) == k
            total = sum(x["rounds"] for x in p["repeats"])
            assert close(p["acceptance_per_position"][0], sum(x["accepted_per_position"][0] for x in p["repeats"]) / total)
        else:
            floor = shapes.decode_floor_ms(cfg, p["context"] + p["max_tokens"] / 2, bw, "float32", "float32")
            assert close(p["roofline_fraction"], floor / p["ms_per_round_best"])
        if p["context"] == r["plan"]["reference"]["decode_context"]:
            ms.setdefault(p["draft_vocab"] or 0, {})[k] = p["ms_per_round_best"]
    # the headline keeps the cheaper drafting option: the full vocabulary or the reduced one
    full = ms.pop(0)
    costs = [derive.extra_draft_cost(full)] + [derive.extra_draft_cost({0: full[0], **m}) for m in ms.values()]
    assert close(r["headline"]["extra_draft_cost_fraction"], min(costs))
    assert any(p["draft_vocab"] for p in points)                         # the reduced draft vocabulary ran


def test_concurrency_kv_and_tp_ratios(cpu_run):
    _, _, r = cpu_run
    conc = {p["streams"]: p for p in r["sections"]["concurrency"]["points"]}
    for p in conc.values():
        assert len(p["per_stream_tok_s"]) == p["streams"]
        assert close(p["aggregate_tok_s"], sum(p["per_stream_tok_s"]))
    assert close(r["headline"]["agg_decode_2_streams"], conc[2]["aggregate_tok_s"] / conc[1]["aggregate_tok_s"])
    burst = r["sections"]["concurrency"]["ttft_burst"]
    alone = sorted(x["ttft_s"] for x in burst["alone"])
    pooled = sorted(x["ttft_s"] for b in burst["bursts"] for x in b)
    assert len(pooled) == burst["streams"] * burst["repeats"] and all(len(b) == burst["streams"] for b in burst["bursts"])
    assert all(x["completion_tokens"] == 1 and x["prompt_tokens"] == burst["prompt"] for b in burst["bursts"] for x in b)
    assert close(r["headline"]["ttft_8x512_over_single"], statistics.median(pooled) / statistics.median(alone))
    inter = r["sections"]["concurrency"]["prefill_interference"]
    assert {"max_gap_ms", "chunk_ms", "ok", "chunks", "chunk_gaps"} <= set(inter)
    assert inter["ok"] == (inter["stream_outlived_prefill"] and inter["chunk_gaps"] >= inter["chunks"])
    assert inter["chunks"] == -(-inter["long_prompt"] // inter["chunk"])
    kv = r["sections"]["kv"]
    assert kv["int8_over_bf16"] == r["headline"]["int8_over_bf16_kv_decode_32k"]
    tp = r["sections"]["tp"]
    tp1, tp2 = (next(p for p in tp["points"] if p["label"] == lab) for lab in ("tp1", "tp2"))
    assert tp2["engine"]["tensor_parallel_size"] == 2
    assert close(r["headline"]["tp2_over_tp1_decode_b1"], tp2["decode_tok_s_peak"] / tp1["decode_tok_s_peak"])
    pre = {(p["label"], p["P"]): p["prefill_tok_s_peak"] for p in tp["prefill"]}
    assert set(pre) == {(lab, P) for lab in ("tp1", "tp2") for P in r["plan"]["tp"]["prefill_prompts"]}
    for P in r["plan"]["tp"]["prefill_prompts"]:
        assert close(tp["tp2_over_tp1_prefill"][str(P)], pre[("tp2", P)] / pre[("tp1", P)])


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
        assert close(p["floor_ms"], want) and close(p["roofline_fraction"], want / p["ms_per_round_best"])
        # only the full-attention layers keep KV; the linear layers' state is read and written once
        kv_layers = len(cfg.full_attention_layers)
        assert kv_layers < cfg.num_hidden_layers
        assert shapes.kv_bytes_per_token(cfg, "bfloat16") == kv_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
        assert shapes.state_bytes_per_step(cfg, 2) == 2 * hyb["state_bytes_per_request_per_rank"] > 0
    first = min(points, key=lambda p: p["context"])
    assert close(r["headline"]["hybrid_27b_tp2_decode_roofline_fraction"], first["roofline_fraction"])
    lc = hyb["long_context"]
    assert r["headline"]["hybrid_192k_ok"] is True
    assert lc["context"] == r["plan"]["hybrid"]["long_context"] and lc["finish_reason"] == "length"
    one = hyb["one_gpu"]
    assert one["model"] == f"preset:{hyb['shape']}-nvfp4" and one["point"]["engine"]["tensor_parallel_size"] == 1
    assert close(one["point"]["roofline_fraction"], one["point"]["floor_ms"] / one["point"]["ms_per_round_best"])
    assert r["headline"]["hybrid_one_gpu_192k_ok"] is True
    assert one["long_context"]["completion_tokens"] == r["plan"]["hybrid"]["long_decode_tokens"]


def test_quant_section_runs_the_seeds_one_gpu_deployment_on_the_dense_shape(cpu_run):
    """The quant section ends with the seed's deployment: the dense shape in NVFP4, int8 KV, one engine
    of one rank, a decode point against its own floor and the long context decoded whole."""
    _, _, r = cpu_run
    quant = r["sections"]["quant"]
    assert quant["status"] == "ok", quant.get("error")
    batched = [p["decode_b8"] for p in quant["points"] if "decode_b8" in p]
    assert batched, quant["points"]
    for b8 in batched:   # the best batch of streams is the aggregate, and its streams are the ones reported
        assert len(b8["aggregate_tok_s_per_batch"]) == r["plan"]["quant"]["batch_repeats"]
        assert len(b8["per_stream_tok_s"]) == b8["streams"]
        assert close(b8["aggregate_tok_s"], max(b8["aggregate_tok_s_per_batch"]))
        assert close(b8["aggregate_tok_s"], sum(b8["per_stream_tok_s"]))
    seed = quant["seed_one_gpu"]
    plan = r["plan"]
    assert seed["model"] == f"preset:{plan['quant']['seed_shape']}-nvfp4"
    p = seed["point"]
    assert p["engine"]["tensor_parallel_size"] == 1 and p["engine"]["kv_dtype"] == "int8"
    assert close(p["roofline_fraction"], p["floor_ms"] / p["ms_per_round_best"])
    assert r["headline"]["seed_32b_nvfp4_one_gpu_192k_ok"] is True
    lc = seed["long_context"]
    assert lc["context"] == plan["hybrid"]["long_context"]
    assert lc["completion_tokens"] == plan["hybrid"]["long_decode_tokens"] and lc["finish_reason"] == "length"
