"""The headline keys: each one's target, what it measures, and the tensor-parallel size it is stated at.

Every key is derived by tools/bench/derive.py from the run's own raw figures (tools/bench/headline.py)
and its record carries the TP size it was measured at; a figure measured at another TP size than its
target's is not that key (null, with the reason; the figure stays in its section).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Target:
    comparison: str | None          # ">=", "<=", "==", or None (reported, no target)
    value: Any
    text: str
    tp: int = 1                     # the tensor-parallel size the target is stated at

    def __iter__(self):             # `op, target, text = TARGETS[name]`
        return iter((self.comparison, self.value, self.text))


T = Target
TARGETS: dict[str, Target] = {
    "decode_b1_roofline_fraction": T(">=", 0.85, "decode batch 1, qwen3-8b bf16, TP1: >= 0.85 x memory roofline"),
    "decode_b1_over_compiled_peer": T(">=", 1.15, "decode batch 1 (k=0, reference context) against the Qwen3 step in "
                                                  "plain PyTorch run as gpt-fast runs it (whole step compiled, "
                                                  "coordinate-descent tuning, one CUDA graph per step; same run): >= 1.15x"),
    "prefill_4k_vs_transformers": T(">=", 1.05, "prefill P=4096 chunk 4096: >= 1.05 x transformers"),
    "prefill_4k_mfu": T(">=", 0.70, "prefill P=4096 chunk 4096: MFU >= 0.70 (model FLOPs: 2 x params without the "
                                    "embedding table and lm_head + attention; lm_head for the last token)"),
    "prefill_32k_over_4k": T(">=", 0.72, "prefill at P=32768 relative to P=4096: >= 0.72"),
    "prefill_32k_vs_transformers": T(">=", 1.10, "prefill P=32768 against transformers (same run): >= 1.10x"),
    "extra_draft_cost_fraction": T("<=", 0.05, "one extra draft token: <= 5% of a k=0 step"),
    "tp2_over_tp1_decode_b1": T(">=", 1.7, "TP2 over TP1, decode batch 1: >= 1.7x", tp=2),
    "tp2_over_tp1_agg_8": T(">=", 1.5, "TP2 over TP1, aggregate decode at 8 streams: >= 1.5x", tp=2),
    "tp2_over_tp1_prefill_512": T(">=", 1.3, "TP2 over TP1, prefill at P=512: >= 1.3x", tp=2),
    "tp2_32b_roofline_fraction": T(">=", 0.80, "qwen3-32b TP2 decode batch 1: >= 0.80 x its roofline", tp=2),
    "agg_decode_2_streams": T(">=", 1.9, "aggregate decode, 2 streams: >= 1.9x one"),
    "agg_decode_8_streams": T(">=", 6.5, "aggregate decode, 8 streams: >= 6.5x one"),
    "int8_over_bf16_kv_decode_32k": T(">=", 1.10, "int8 KV vs bf16 KV, decode at 32k context: >= 1.10x"),
    "context_192k_ok": T("==", True, "a 192k-token context on qwen3-32b int8 KV, TP2: prefill + >= 512 decoded tokens",
                         tp=2),
    "ttft_8x512_over_single": T("<=", 3.0, "median TTFT of 8 prompts of 512 tokens sent together over one alone: <= 3"),
    "e2e_decode_b1_over_inproc": T(">=", 0.97, "served (engine + gateway processes, gRPC client) over in-process: "
                                               "decode, 1 stream >= 0.97"),
    "e2e_agg_8_over_inproc": T(">=", 0.95, "served over in-process: aggregate decode, 8 streams >= 0.95"),
    "e2e_ttft_added_ms": T("<=", 2.0, "served: TTFT added over in-process <= 2 ms (median of >= 32 interleaved paired "
                                      "differences, 512-token prompt)"),
    "nvfp4_over_bf16_decode_b1": T(">=", 2.4, "NVFP4 over bf16 weights, decode batch 1, qwen3-8b"),
    "fp8_over_bf16_decode_b1": T(">=", 1.6, "FP8 block over bf16 weights, decode batch 1, qwen3-8b"),
    "fp8_over_bf16_prefill_4k": T(">=", 1.3, "FP8 block over bf16 weights, prefill P=4096 in one chunk, qwen3-8b"),
    "w4a16_over_bf16_decode_b1": T(">=", 2.6, "INT4 weight-only (group 128) over bf16, decode batch 1, qwen3-8b"),
    "fp16_over_bf16_decode_b1": T(">=", 0.97, "fp16 over bf16 (the portable path, same shape), decode batch 1"),
    "nvfp4_mtp3_b1_implied_tok_s": T(">=", 1000.0, "qwen3-8b NVFP4 + MTP k=3, batch 1: tokens per round at the small "
                                                   "trained model's prose acceptance (T=0) over the measured ms per "
                                                   "round: >= 1,000 tok/s"),
    "structured_decode_overhead_b1": T("<=", 0.05, "JSON-schema constrained decode over unconstrained, batch 1: "
                                                   "<= 0.05 (time per token, minus one)"),
    "structured_decode_overhead_b32": T("<=", 0.10, "JSON-schema constrained decode over unconstrained, batch 32: "
                                                    "<= 0.10"),
    "hybrid_27b_tp2_decode_roofline_fraction": T(">=", 0.80, "Qwen3.5-27B shape, TP2, int8 KV, decode batch 1 at the "
                                                             "reference context against its roofline", tp=2),
    "hybrid_192k_ok": T("==", True, "Qwen3.5-27B shape, TP2, int8 KV: a 192k-token context, prefill + 512 decoded "
                                    "tokens", tp=2),
    "hybrid_one_gpu_192k_ok": T("==", True, "Qwen3.5-27B shape in NVFP4, int8 KV, one GPU: a 192k-token context, "
                                            "prefill + 512 decoded tokens"),
    "seed_32b_nvfp4_one_gpu_192k_ok": T("==", True, "qwen3-32b in NVFP4, int8 KV, one GPU: a 192k-token context, "
                                                    "prefill + 512 decoded tokens"),
    "fp8_decode_b1_roofline_fraction": T(None, None, "FP8 decode batch 1: its bytes per step over the copy bandwidth"),
    "nvfp4_decode_b1_roofline_fraction": T(None, None, "NVFP4 decode batch 1: its bytes per step over the copy bandwidth"),
    "moe_30b_a3b_decode_b1_roofline_fraction": T(">=", 0.60, "Qwen3-30B-A3B-shape MoE decode batch 1 against the "
                                                             "roofline of the bytes it reads (the experts routed to)"),
    "moe_30b_a3b_tp2_over_tp1_decode_b1": T(">=", 1.3, "that MoE, TP2 over TP1, decode batch 1", tp=2),
    "pd_kv_transfer_gbps": T(None, None, "prefill -> decode KV transfer between engines on two GPUs (GB/s)"),
}
