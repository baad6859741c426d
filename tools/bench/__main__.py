"""ninfer's benchmark: `python -m tools.bench [--sections ...] [--model-shape qwen3-8b] [--device cuda]
[--quick] [--out DIR]`.

Measures the engine through its public API against the physical limits and the transformers peer,
all in the same run, section by section: a section that fails (OOM, exception) is
recorded and the run goes on. Progress goes to stderr as each figure lands; results.json is
rewritten after every figure (a run cut short keeps what it measured); summary.md and the plots
after every section; a compact table is printed last on stdout.

Resuming: `--merge OLD/results.json` keeps the sections of an earlier run that this one does not
re-run (e.g. a 2-GPU run adding tp to a 1-GPU run); `--report-only results.json` rebuilds the
summary, plots and table without measuring anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import secrets
import shlex
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

ORDER = ["roofline", "peer", "prefill", "concurrency", "decode", "kv", "tp", "acceptance", "e2e", "quant", "hybrid",
         "moe", "structured", "pd"]
NEEDS_ROOFLINE = {"prefill", "decode", "kv", "tp", "peer", "concurrency", "acceptance", "quant", "hybrid", "moe"}


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tools.bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default=",".join(ORDER),
                    help=f"comma-separated, any of {','.join(ORDER)} (run in that order; roofline is added "
                         "when a section needs it)")
    ap.add_argument("--in-given-order", action="store_true",
                    help="run the sections in the order --sections names them (roofline first), e.g. the quick keys "
                         "before a long compile; by default the order above, in which consecutive sections share "
                         "an engine")
    ap.add_argument("--model-shape", default=None, help="qwen3-8b (default on a GPU), qwen3-32b, tiny (default on CPU)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--quick", action="store_true", help="fewer points and repeats (~3 minutes on one H200)")
    ap.add_argument("--out", default=None, help="output folder (default $OUT, else bench/results/<date>-<device>-<commit>/)")
    ap.add_argument("--acceptance-model", default=None,
                    help="the small trained model (default: .models/tiny-qwen3-mtp or ../shared/models/tiny-qwen3-mtp)")
    ap.add_argument("--repeats", type=int, default=None, help="repeats of every point (peak = max, and the median)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="multiply every time budget (precision for time)")
    ap.add_argument("--budget-s", type=float, default=None, help="whole-run time budget in seconds (default per mode)")
    ap.add_argument("--merge", action="append", default=[], help="an earlier results.json whose other sections to keep")
    ap.add_argument("--report-only", default=None, help="rebuild summary, plots and table from this results.json")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--quant-shapes", default=None,
                    help="the quant section's shapes compared in bf16/FP8/NVFP4 (comma-separated; 'none' for only "
                         "the seed's one-GPU deployment)")
    ap.add_argument("--quant-seed-shape", default=None,
                    help="the shape of the quant section's one-GPU NVFP4 192k deployment ('' or 'none' = not run; default qwen3-32b)")
    ap.add_argument("--quant-formats", default=None, help="the quant section's formats (comma-separated: bf16,fp8,nvfp4)")
    ap.add_argument("--quant-decode-only", action="store_true",
                    help="the quant section measures decode batch 1 only (an A/B of the decode step)")
    ap.add_argument("--quant-mtp-k", type=int, default=None,
                    help="drafts of the quant section's NVFP4 + MTP round against NVFP4 at k = 0 (default 3; 0 = not run)")
    ap.add_argument("--decode-ks", default=None,
                    help="the decode section's draft lengths with the full draft vocabulary (comma-separated; '' = none)")
    ap.add_argument("--decode-draft-vocab-ks", default=None,
                    help="the decode section's draft lengths with the reduced draft vocabulary ('' = none)")
    ap.add_argument("--decode-contexts", default=None,
                    help="keep only these decode contexts (comma-separated prompt tokens), e.g. 512 for a quick A/B")
    ap.add_argument("--peer-parts", default=None,
                    help="the peer section's parts: transformers (prefill pairs, generate()), compiled (the gpt-fast-"
                         "style step against the engine); default both")
    ap.add_argument("--peer-compile-mode", default=None,
                    help="the compiled step's torch.compile mode: max-autotune-no-cudagraphs (default; the step "
                         "captured here as one CUDA graph) or reduce-overhead (Inductor's CUDA graphs)")
    ap.add_argument("--e2e-tps", default=None, help="the e2e section's TP sizes (comma-separated), e.g. 1")
    ap.add_argument("--e2e-ks", default=None, help="the e2e section's draft lengths (comma-separated), e.g. 0")
    ap.add_argument("--e2e-streams", default=None, help="the e2e section's stream counts (comma-separated), e.g. 1,8")
    ap.add_argument("--moe-shape", default=None, help="the moe section's preset (default qwen3-30b-a3b)")
    ap.add_argument("--hybrid-deployments", default=None,
                    help="the hybrid section's deployments: tp (the shape at TP=2), one_gpu (quantized, one GPU); "
                         "default both")
    ap.add_argument("--hybrid-decode-contexts", default=None,
                    help="the hybrid section's decode contexts (comma-separated; '' = none)")
    ap.add_argument("--hybrid-prefill-prompts", default=None,
                    help="the hybrid section's fresh prefill prompts (comma-separated tokens; '' = none)")
    ap.add_argument("--structured-tokenizer", default=None,
                    help="the structured section's vocabulary: a directory with tokenizer.json (e.g. a real Qwen3 "
                         "one; default: the small trained model's)")
    ap.add_argument("--hybrid-long-context", type=int, default=None,
                    help="the hybrid section's long context in tokens, prompt plus decoded (0 = not run)")
    return ap.parse_args(argv)


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def _narrow_decode(plan, args) -> None:
    """The decode flags: fewer draft lengths or contexts than the mode's plan (an interleaved A/B of a round's
    cost wants k = 0 and the draft-vocabulary k's at one context, not the whole grid)."""
    if args.decode_ks is not None:
        plan.ks = _ints(args.decode_ks)
    if args.decode_draft_vocab_ks is not None:
        plan.draft_vocab_ks = _ints(args.decode_draft_vocab_ks)
    if args.decode_contexts:
        keep = _ints(args.decode_contexts)
        plan.contexts = {k: [c for c in cs if c in keep] or keep[:1] for k, cs in plan.contexts.items()}
    for k in plan.ks + plan.draft_vocab_ks:
        plan.contexts.setdefault(k, plan.contexts.get(0) or [512])


def _narrow_quant(plan, args) -> None:
    """The quant flags: fewer formats, or decode batch 1 alone (an A/B of the decode step, ~half the time)."""
    if args.quant_formats:
        plan.formats = [f.strip() for f in args.quant_formats.split(",") if f.strip()]
    plan.decode_only = plan.decode_only or args.quant_decode_only
    if args.quant_mtp_k is not None:
        plan.mtp_k = args.quant_mtp_k


def _narrow_other(plan, args) -> None:
    """The peer, e2e and moe flags."""
    if args.peer_parts:
        plan.peer.parts = tuple(p.strip() for p in args.peer_parts.split(",") if p.strip())
    if args.peer_compile_mode:
        plan.peer.compiled_mode = args.peer_compile_mode
    if args.e2e_tps:
        plan.e2e.tps = _ints(args.e2e_tps)
    if args.e2e_ks:
        plan.e2e.ks = _ints(args.e2e_ks)
    if args.e2e_streams:
        plan.e2e.streams = _ints(args.e2e_streams)
    if args.moe_shape:
        plan.moe.shape = args.moe_shape


def run_order(selected: list[str], given: bool) -> list[str]:
    """The sections to run, in the bench's order or, when `given`, in the order named (roofline first:
    the others read its limits)."""
    if not given:
        return [name for name in ORDER if name in selected]
    named = list(dict.fromkeys(selected))
    return ["roofline"] * ("roofline" in named) + [name for name in named if name != "roofline"]


def _quiet_engine_logs() -> None:
    """The engine logs through structlog (stdout by default): send it to stderr, so that stdout ends
    with the final table."""
    import structlog
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))


def _report_only(args) -> int:
    from tools.bench import derive, report
    src = Path(args.report_only)
    results = json.loads(src.read_text())
    for m in args.merge:
        _merge(results, json.loads(Path(m).read_text()), set())
    derive.annotate(results)
    out = Path(args.out) if args.out else src.parent
    report.write(results, out, plots=not args.no_plots)
    print(report.final_table(results, out))
    return 0


def _merge(results: dict, old: dict, running: set[str]) -> None:
    """Take the other run's sections that this run does not measure, or has only as skipped or failed
    (a one-GPU run's skipped `tp` gives way to a two-GPU run's measured one)."""
    results.setdefault("runs", {}).update(old.get("runs", {}))
    for name, sec in old.get("sections", {}).items():
        mine = results["sections"].get(name)
        if name in running:
            continue
        if mine is None or (mine.get("status") != "ok" and sec.get("status") == "ok"):
            results["sections"][name] = sec
    # keep a stable section order
    results["sections"] = {n: results["sections"][n] for n in ORDER if n in results["sections"]}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    _quiet_engine_logs()
    if args.report_only:
        return _report_only(args)

    import torch
    from tools.bench import (acceptance, concurrency, decode, e2e, hybrid, kv, moe, pd, peer, prefill, quant, report,
                             roofline, runinfo, structured, tp)
    from tools.bench.context import Bench
    from tools.bench.plan import make_plan
    from tools.bench.progress import Budget, say
    from tools.bench.session import free_memory

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    shape = args.model_shape or ("tiny" if device == "cpu" else "qwen3-8b")
    selected = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in selected if s not in ORDER]
    if unknown:
        print(f"unknown sections: {', '.join(unknown)}; known: {', '.join(ORDER)}", file=sys.stderr)
        return 2
    if NEEDS_ROOFLINE & set(selected) and "roofline" not in selected:
        selected.append("roofline")
    order = run_order(selected, args.in_given_order)
    plan = make_plan(device, shape, args.quick, args.repeats, args.time_scale)
    if args.budget_s:
        plan.global_s = args.budget_s
    if args.quant_shapes:
        plan.quant.shapes = [] if args.quant_shapes == "none" else [x.strip() for x in args.quant_shapes.split(",")]
    _narrow_quant(plan.quant, args)
    if args.quant_seed_shape is not None:
        plan.quant.seed_shape = "" if args.quant_seed_shape == "none" else args.quant_seed_shape
    _narrow_decode(plan.decode, args)
    _narrow_other(plan, args)
    if args.hybrid_deployments:
        plan.hybrid.deployments = tuple(d.strip() for d in args.hybrid_deployments.split(",") if d.strip())
    if args.hybrid_decode_contexts is not None:
        plan.hybrid.decode_contexts = _ints(args.hybrid_decode_contexts)
    if args.hybrid_prefill_prompts is not None:
        plan.hybrid.prefill_prompts = _ints(args.hybrid_prefill_prompts)
    if args.hybrid_long_context is not None:
        plan.hybrid.long_context = args.hybrid_long_context
    if args.structured_tokenizer:
        plan.structured.tokenizer = args.structured_tokenizer
    info = runinfo.collect(device)
    run_id = f"{info['date'][:10]}-{(info['git']['commit'] or 'nogit')[:8]}-{secrets.token_hex(2)}"
    info.update(run_id=run_id, shape=shape, mode=plan.mode, sections=order,
                command="python -m tools.bench " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])))
    out = Path(args.out) if args.out else runinfo.default_out_dir(info)
    results = {"schema": "ninfer-bench/1", "run": info, "runs": {run_id: info},
               "plan": dataclasses.asdict(plan), "sections": {}}
    for m in args.merge:
        _merge(results, json.loads(Path(m).read_text()), set(selected))
    from tools.bench import shapes
    results["shape"] = shapes.describe(shapes.model_config(shape), "bfloat16" if device != "cpu" else "float32")
    acc_model = acceptance.find_model(args.acceptance_model, runinfo.REPO)
    bench = Bench(plan, device, results, out, acc_model, write_plots=not args.no_plots)
    modules = {"roofline": roofline, "peer": peer, "prefill": prefill, "concurrency": concurrency, "decode": decode,
               "kv": kv, "tp": tp, "acceptance": acceptance, "e2e": e2e, "quant": quant, "hybrid": hybrid, "moe": moe,
               "structured": structured, "pd": pd}

    old_term = None
    if threading.current_thread() is threading.main_thread():
        def on_term(signum, frame):
            raise SystemExit(128 + signum)
        old_term = signal.signal(signal.SIGTERM, on_term)
    t_start = time.monotonic()
    deadline = t_start + plan.global_s
    say("bench", f"{shape} on {info['device']['name']} ({plan.mode}); sections {', '.join(order)}; "
                 f"budget {plan.global_s:.0f} s; writing {out}")
    try:
        for name in order:
            sec = results["sections"][name] = {"run_id": run_id}
            results["sections"] = {n: results["sections"][n] for n in ORDER if n in results["sections"]}
            if time.monotonic() >= deadline:
                sec.update(status="skipped", reason=f"the run's time budget ({plan.global_s:.0f} s) is spent")
                say(name, sec["reason"])
                continue
            bench.budget = Budget(plan.budgets.get(name, 60.0), hard_deadline=deadline)
            t0 = time.monotonic()
            say(name, f"start (budget {bench.budget.left():.0f} s)")
            try:
                modules[name].run(bench, sec)
                sec.setdefault("status", "ok")
            except (KeyboardInterrupt, SystemExit):
                sec["status"] = "interrupted"
                sec["reason"] = "the run was stopped during this section; the figures above were kept"
                raise
            except Exception as e:  # noqa: BLE001 - a section's failure is a result; the run goes on
                sec["status"] = "error"
                sec["error"] = f"{type(e).__name__}: {e}"[:600]
                sec["traceback"] = traceback.format_exc()[-2000:]
                say(name, f"ERROR {sec['error'][:300]}")
                bench.pool.close()
                free_memory()
            finally:
                sec["elapsed_s"] = round(time.monotonic() - t0, 2)
                bench.save(full=True)
                say(name, f"done in {sec['elapsed_s']:.1f} s ({sec.get('status')})")
    except (KeyboardInterrupt, SystemExit) as e:
        results.setdefault("warnings", []).append(f"run interrupted ({e!r}) after {time.monotonic() - t_start:.0f} s")
        for name in ORDER:
            if name in selected and results["sections"].get(name, {}).get("run_id") != run_id:
                results["sections"][name] = {"run_id": run_id, "status": "skipped", "reason": "the run was interrupted"}
        results["sections"] = {n: results["sections"][n] for n in ORDER if n in results["sections"]}
        say("bench", "interrupted: writing what was measured")
    finally:
        bench.pool.close()
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
        results["run"]["elapsed_s"] = round(time.monotonic() - t_start, 1)
        bench.save(full=True)
        sys.stderr.flush()
        print(report.final_table(results, out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
