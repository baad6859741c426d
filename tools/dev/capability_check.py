"""Run an older GPU's kernel paths on this one and compare with the CPU's float32 engine.

    NINFER_KERNEL_CAPABILITY=7.0 python -m tools.dev.capability_check --dtype float16 [--kv-dtype int8] [--model DIR]

For each shared model (../shared/models/tiny-qwen3-mtp, tiny-qwen3_5-mtp; or each --model): greedy 32-token continuations of
eight prompts and every prompt position's logits on cuda (the paths engine/platform.py picks for the capability
named, e.g. sm70: float16, paged attention, no PDL, quantized weights dequantized by torch) against the CPU engine
in float32. Prints the kernel paths, identical continuations, top-1 agreement and the largest logit error.
It proves the selection logic and the fallback code on real silicon; the code still compiles for this GPU's
architecture, so it does not prove an sm70 cubin runs (docs/hardware.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from engine import LLM, SamplingParams

MODELS = Path(__file__).resolve().parents[3] / "shared" / "models"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,", "1, 2, 3, 4,",
           "Translate to German: good morning", "The quick brown fox", "import numpy as np\n", "Water boils at"]


def run(path: Path, device: str, dtype: str, kv_dtype: str) -> tuple[list[list[int]], list[torch.Tensor], dict]:
    llm = LLM(str(path), device=device, dtype=dtype, kv_dtype=kv_dtype, kv_capacity=8192)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0.0))
    logits = [llm.prompt_logits(p).float().cpu() for p in PROMPTS]
    return [o.outputs[0].token_ids for o in outs], logits, dict(llm.engine.info().kernel_paths)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-dtype", default="auto")
    parser.add_argument("--model", action="append", help="a model directory (repeatable); default: the shared models")
    args = parser.parse_args()
    models = [Path(m) for m in args.model] if args.model else [MODELS / "tiny-qwen3-mtp", MODELS / "tiny-qwen3_5-mtp"]
    for path in models:
        name = path.name
        ref_tokens, ref_logits, _ = run(path, "cpu", "float32", "auto")
        tokens, logits, paths = run(path, args.device, args.dtype, args.kv_dtype)
        identical = sum(a == b for a, b in zip(ref_tokens, tokens))
        top1 = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(ref_logits, logits))
        positions = sum(a.shape[0] for a in ref_logits)
        err = max(float((a - b).abs().max() / a.abs().max()) for a, b in zip(ref_logits, logits))
        print(f"{name}: paths {paths}")
        print(f"{name}: identical greedy {identical}/{len(PROMPTS)}, prompt top-1 {top1}/{positions}, "
              f"max logit error {err:.4f} of the largest")


if __name__ == "__main__":
    main()
