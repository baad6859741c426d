"""Command-line flags for an engine (vLLM spellings), shared by `ninfer generate`, `engine`, `serve`."""

from __future__ import annotations

import argparse

from engine.config import EngineConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="Hugging Face model directory (default: the embedded tiny model)")
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    g.add_argument("--dtype", default="auto", help="auto, bfloat16, float16 or float32")
    g.add_argument("--kv-dtype", default="auto", help="auto (= dtype) or int8")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV page")
    g.add_argument("--prefill-chunk", type=int, default=2048, help="tokens per prefill step")
    g.add_argument("--kv-capacity", type=int, default=None, help="KV capacity in tokens (default: from memory)")
    g.add_argument("--memory-utilization", type=float, default=0.90, help="share of device memory to use")
    g.add_argument("--draft-tokens", type=int, default=0, help="MTP draft tokens per round (0 = off)")
    g.add_argument("--draft-vocab", type=int, default=0, help="draft over the first N token ids (0 = all)")
    g.add_argument("--max-batch", type=int, default=64, help="requests decoding together")
    g.add_argument("--max-pending", type=int, default=256, help="queued requests before refusing")
    g.add_argument("--pending-timeout-ms", type=int, default=60_000, help="queue wait before a request fails")
    g.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    g.add_argument("--tensor-parallel-size", "--tp", type=int, default=1, help="GPUs to shard the model over")
    g.add_argument("--tp-comm", default="auto", choices=("auto", "p2p", "nccl"),
                   help="TP all-reduce: one-shot peer-to-peer over NVLink, NCCL, or auto (p2p where it works)")
    g.add_argument("--no-prefix-reuse", dest="prefix_reuse", action="store_false", help="never share KV prefixes")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")


def engine_config_from_args(args: argparse.Namespace, **extra) -> EngineConfig:
    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, kv_dtype=args.kv_dtype,
        block_size=args.block_size, prefill_chunk=args.prefill_chunk, kv_capacity=args.kv_capacity,
        memory_utilization=args.memory_utilization, draft_tokens=args.draft_tokens,
        draft_vocab=args.draft_vocab, max_batch=args.max_batch, max_pending=args.max_pending,
        pending_timeout_ms=args.pending_timeout_ms, max_model_len=args.max_model_len,
        tensor_parallel_size=args.tensor_parallel_size, tp_comm=args.tp_comm, prefix_reuse=args.prefix_reuse,
        enforce_eager=args.enforce_eager, extra=extra)
