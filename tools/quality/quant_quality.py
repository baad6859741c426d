"""Quality of the quantized formats on a real model: `python -m tools.quality.quant_quality --model DIR --out DIR`.

Quantizes the model with the quantize tool (`engine.quant.quantize`) into each format, then against
the unquantized model (all runs float32 activations on the CPU, so the figures isolate the weights):
  - teacher-forced top-1 agreement: at every position of the held-out texts (tools/quality/quant_quality_texts.py),
    does the quantized model's most likely next token equal the unquantized one's;
  - greedy output of 16 prompts x 64 tokens: identical sequences, mean length of the common prefix,
    position-wise token agreement;
  - MTP acceptance per draft position (k = 3, greedy) of each model on the same 16 prompts.
Writes quality.json and quality.md to --out.

With --checkpoints DIR (tools/dev/make_quant_fixtures.py --quality-out DIR: each layout from its real producer,
DIR/<layout>/<arch>/) it measures those checkpoints instead, and with --online the engine's `--quantization`
methods; a checkpoint its producer wrote without the MTP head drafts with the base model's
(`--speculative-model`), which the JSON records.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

FORMATS = ("fp8", "nvfp4", "nvfp4-search")     # nvfp4-search: the quantize tool's --scale-search
K = 3


def _llm(model: str, draft_tokens: int = 0, **kw):
    from engine.llm import LLM
    return LLM(model, dtype="float32", kv_capacity=8192, draft_tokens=draft_tokens, **kw)


def _has_mtp(path: str) -> bool:
    from engine.loading.checkpoint import MTP_PREFIX, read_checkpoint
    return any(n.startswith(MTP_PREFIX) for n in read_checkpoint(path)[2].shapes())


def measure_layouts(model: str, checkpoints: dict[str, str], online: tuple[str, ...] = (), texts=None,
                    prompts=None, max_tokens: int = 64, with_mtp: bool = True, on_entry=None) -> dict:
    """The figures of `measure` for producers' checkpoints (name -> directory, measured in that order) and
    `--quantization` methods; `on_entry(result)` after each (a long run keeps what it measured if cut off)."""
    from tools.quality.quant_quality_texts import PROMPTS, TEXTS
    texts, prompts = texts or TEXTS, prompts or PROMPTS
    result: dict = {"model": model, "activations": "float32 (CPU)", "max_tokens": max_tokens,
                    "prompts": sum(len(v) for v in prompts.values()), "formats": {}}
    base = _llm(model)
    base_greedy = greedy(base, prompts, max_tokens)
    if with_mtp:
        result["bf16_acceptance_k3"] = acceptance(greedy(_llm(model, K), prompts, max_tokens))
    runs = {name: ({"model": path}, path) for name, path in checkpoints.items()}
    runs.update({f"--quantization {m}": ({"model": model, "quantization": m}, model) for m in online})
    for name, (kw, path) in runs.items():
        start = time.perf_counter()
        quant = _llm(**kw)
        scheme = quant.engine.model_config.quant
        entry = {"layout": scheme.format, "quantized_modules": len(scheme.modules),
                 "teacher_forced": teacher_forced(base, quant, texts),
                 "greedy": compare_greedy(base_greedy, greedy(quant, prompts, max_tokens))}
        if with_mtp:
            own = _has_mtp(path)
            spec = {} if own else {"speculative_model": model}
            entry["mtp_head"] = "the checkpoint's own" if own else "the bf16 model's (--speculative-model)"
            entry["acceptance_k3"] = acceptance(greedy(_llm(**kw, draft_tokens=K, **spec), prompts, max_tokens))
        entry["seconds"] = round(time.perf_counter() - start, 1)
        result["formats"][name] = entry
        print(f"{name}: top-1 {entry['teacher_forced']['overall']['agreement']:.3f}", flush=True)
        if on_entry is not None:
            on_entry(result)
    return result


def _spec(stats) -> tuple[list[int], int]:
    """(accepted per position, rounds) of one request's stats (dict or typed)."""
    spec = stats["speculative"] if isinstance(stats, dict) else stats.speculative
    if isinstance(spec, dict):
        return list(spec["accepted_per_position"]), spec["rounds"]
    return list(spec.accepted_per_position), spec.rounds


def teacher_forced(base, quant, texts: dict[str, list[str]]) -> dict[str, dict]:
    out = {}
    for kind, items in texts.items():
        agree = total = 0
        for text in items:
            a, b = base.prompt_logits(text).argmax(-1), quant.prompt_logits(text).argmax(-1)
            agree += int((a == b).sum())
            total += a.numel()
        out[kind] = {"agreement": agree / total, "positions": total}
    agree = sum(v["agreement"] * v["positions"] for v in out.values())
    total = sum(v["positions"] for v in out.values())
    out["overall"] = {"agreement": agree / total, "positions": total}
    return out


def greedy(llm, prompts: dict[str, list[str]], max_tokens: int) -> dict[str, list]:
    from engine.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    return {kind: llm.generate(items, params) for kind, items in prompts.items()}


def compare_greedy(base: dict, quant: dict) -> dict:
    same = prefix = agree = total = n = 0
    for kind in base:
        for a, b in zip(base[kind], quant[kind]):
            x, y = a.token_ids, b.token_ids
            n += 1
            same += x == y
            p = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            prefix += p
            agree += sum(u == v for u, v in zip(x, y))
            total += len(x)
    return {"sequences": n, "identical": same, "mean_common_prefix": prefix / n, "token_agreement": agree / total}


def acceptance(outputs: dict) -> dict[str, list[float]]:
    out, pooled_acc, pooled_rounds = {}, [0] * K, 0
    for kind, items in outputs.items():
        acc, rounds = [0] * K, 0
        for o in items:
            per, r = _spec(o.stats)
            acc = [s + v for s, v in zip(acc, per)]
            rounds += r
        out[kind] = [a / rounds for a in acc] if rounds else []
        pooled_acc = [s + v for s, v in zip(pooled_acc, acc)]
        pooled_rounds += rounds
    out["overall"] = [a / pooled_rounds for a in pooled_acc] if pooled_rounds else []
    return out


def measure(model: str, formats=FORMATS, texts=None, prompts=None, max_tokens: int = 64,
            workdir: str | None = None, with_mtp: bool = True) -> dict:
    """Every figure of the module docstring, for each format, as one dict."""
    from engine.quant.quantize import quantize_checkpoint
    from tools.quality.quant_quality_texts import PROMPTS, TEXTS
    texts, prompts = texts or TEXTS, prompts or PROMPTS
    result: dict = {"model": model, "activations": "float32 (CPU)", "max_tokens": max_tokens,
                    "prompts": sum(len(v) for v in prompts.values()), "formats": {}}
    base = _llm(model)
    base_greedy = greedy(base, prompts, max_tokens)
    if with_mtp:
        result["bf16_acceptance_k3"] = acceptance(greedy(_llm(model, K), prompts, max_tokens))
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        for fmt in formats:
            start = time.perf_counter()
            qdir = Path(tmp) / fmt
            scheme = quantize_checkpoint(Path(model), qdir, fmt.split("-")[0], scale_search=fmt.endswith("-search"))
            quant = _llm(str(qdir))
            entry = {"quantized_modules": len(scheme.modules), "kept": ["embeddings", *scheme.exclude],
                     "teacher_forced": teacher_forced(base, quant, texts),
                     "greedy": compare_greedy(base_greedy, greedy(quant, prompts, max_tokens))}
            if with_mtp:
                entry["acceptance_k3"] = acceptance(greedy(_llm(str(qdir), K), prompts, max_tokens))
            entry["seconds"] = round(time.perf_counter() - start, 1)
            result["formats"][fmt] = entry
    return result


def markdown(r: dict) -> str:
    kinds = [k for k in next(iter(r["formats"].values()))["teacher_forced"]]
    lines = [f"# Quantized weights on {Path(r['model']).name}", "",
             f"Activations {r['activations']}; greedy: {r['prompts']} prompts x {r['max_tokens']} tokens; "
             f"MTP k={K} greedy on the same prompts.", "",
             "| format | " + " | ".join(f"top-1 {k}" for k in kinds) + " | greedy identical | common prefix | "
             "greedy token agreement |", "|---" * (len(kinds) + 4) + "|"]
    for fmt, e in r["formats"].items():
        tf, g = e["teacher_forced"], e["greedy"]
        lines.append(f"| {fmt} | " + " | ".join(f"{tf[k]['agreement']:.3f}" for k in kinds)
                     + f" | {g['identical']}/{g['sequences']} | {g['mean_common_prefix']:.1f} | {g['token_agreement']:.3f} |")
    if "bf16_acceptance_k3" in r:
        lines += ["", "MTP acceptance per draft position (k=3, greedy):", "",
                  "| model | workload | pos 1 | pos 2 | pos 3 |", "|---|---|---|---|---|"]
        rows = [("bf16", r["bf16_acceptance_k3"])] + [(f, e["acceptance_k3"]) for f, e in r["formats"].items()]
        for name, acc in rows:
            for kind, per in acc.items():
                lines.append(f"| {name} | {kind} | " + " | ".join(f"{a:.2f}" for a in per) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(Path(__file__).resolve().parents[3] / "shared/models/tiny-qwen3-mtp"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--checkpoints", default=None, metavar="DIR",
                    help="measure the producers' checkpoints DIR/<layout>/<arch> (--arch) instead of --formats")
    ap.add_argument("--arch", default="qwen3", help="with --checkpoints: the subdirectory of each layout to take")
    ap.add_argument("--online", default="", help="with --checkpoints: --quantization methods too, e.g. fp8,ptpc_fp8")
    ap.add_argument("--layouts", default="", help="with --checkpoints: these layouts only, in this order "
                    "(comma-separated; default every one found, by name)")
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def write(r: dict) -> None:
        (out / "quality.json").write_text(json.dumps(r, indent=2) + "\n")
        (out / "quality.md").write_text(markdown(r))

    if args.checkpoints:
        found = {d.name: str(d / args.arch) for d in sorted(Path(args.checkpoints).iterdir())
                 if (d / args.arch / "config.json").exists()}
        if args.layouts:
            wanted = [n for n in args.layouts.split(",") if n]
            missing = [n for n in wanted if n not in found]
            if missing:
                ap.error(f"--layouts: no {args.arch} checkpoint for {', '.join(missing)} in {args.checkpoints}")
            found = {n: found[n] for n in wanted}
        r = measure_layouts(args.model, found, tuple(m for m in args.online.split(",") if m),
                            max_tokens=args.max_tokens, on_entry=write)
    else:
        r = measure(args.model, tuple(args.formats.split(",")), max_tokens=args.max_tokens)
    write(r)
    print(markdown(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
