"""What each run measures: the sweep points, repeats and time budgets of every section, per mode.

Modes: `full` and `quick` on a GPU at a reference shape (qwen3-8b, qwen3-32b), and `cpu` (the tiny preset,
small sizes: a dry run of every code path in well under a minute). Budgets are seconds of wall
time per section; a point predicted not to fit is skipped with the reason, so a run stays bounded
whatever the engine's speed. `--repeats` and `--time-scale` trade time for precision.
"""

from __future__ import annotations

from dataclasses import dataclass, field

K = 1024


@dataclass
class RooflinePlan:
    copy_bytes: int                 # size of the source buffer (bytes moved = 2x: read + write)
    matmul_n: int                   # n of the n x n x n matmul
    matmul_dtype: str
    gemv_rows: int                  # a [rows, cols] weight times one vector: the decode GEMV
    gemv_cols: int
    repeats: int = 20


@dataclass
class PeerPlan:
    prefill_prompts: list[int]      # engine vs transformers, interleaved at each P
    reps: int                       # interleaved rounds of each comparison (a headline needs >= 3)
    decode_prompt: int              # the context of transformers' generate() and of the compiled step
    decode_new_tokens: int          # transformers' generate() (eager: slow)
    compiled_tokens: int            # tokens per rep of the engine and of the compiled step
    compiled_mode: str = "max-autotune-no-cudagraphs"   # or "reduce-overhead" (tools/bench/compiled_peer.py)
    parts: tuple[str, ...] = ("transformers", "compiled")


@dataclass
class PrefillPlan:
    grid: dict[int, list[int]]      # chunk -> prompt lengths P (the chunk is an engine setting)
    repeats: dict[int, int]         # P -> repeats (peak = max, and the median)


@dataclass
class DecodePlan:
    ks: list[int]
    contexts: dict[int, list[int]]  # k -> contexts (prompt tokens before decoding)
    repeats: dict[int, int]         # context -> repeats (the reference context: >= 3, a headline's median)
    draft_vocab: int                # the reduced draft vocabulary option, measured at these k
    draft_vocab_ks: list[int]       # (at the shortest context of each k)
    target_decode_s: float          # aim for this much decode wall time per request ...
    min_tokens: int                 # ... within [min_tokens, max_tokens] generated tokens
    max_tokens: int
    pair_reps: int = 3              # interleaved k0 / k rounds at the reference context


@dataclass
class ConcurrencyPlan:
    streams: list[int]
    context: int
    target_decode_s: float
    min_tokens: int
    max_tokens: int
    interference_prompt: int        # a long prompt arriving while a stream decodes
    burst_streams: int = 8          # TTFT of this many prompts sent together ...
    burst_prompt: int = 512         # ... of this many tokens each, against one alone (tools.bench.burst)
    burst_repeats: int = 3          # rounds of (one alone, the burst)
    reps: int = 3                   # interleaved rounds of the stream counts


@dataclass
class KVPlan:
    contexts: list[int]
    repeats: int                    # interleaved rounds of the two KV dtypes at each context


@dataclass
class TPPlan:
    context: int                    # decode batch 1 at this context
    reps: int                       # interleaved TP1 / TP2 rounds of each figure
    long_context: int               # the 192k request: prompt + decode tokens
    long_decode_tokens: int
    big_shape: str
    prefill_prompts: list[int] = field(default_factory=list)   # TP1 vs TP2 prefill, the plan's chunk
    streams: int = 8                # TP1 vs TP2 aggregate decode of this many streams


@dataclass
class AcceptancePlan:
    ks: list[int]
    temperatures: list[float]
    prompts_per_workload: int
    max_tokens: int
    implied_context: int            # which decode-sweep context's ms_per_round the implied rates use


@dataclass
class E2EPlan:
    prompt: int                     # prompt tokens of every request
    decode_tokens: int              # max_tokens of the decode points (ignore_eos)
    streams: list[int]              # streams sent together; 1 = decode batch 1
    ttft_samples: int               # prompts alone per side, interleaved (the median of >= 32 paired differences)
    reps: int                       # interleaved rounds of each stream count
    tps: list[int]
    ks: list[int]
    draft_vocab: int                # the reduced draft vocabulary of the k > 0 engines
    kv_capacity: int                # every stream of the largest point fits


@dataclass
class PDPlan:
    """tools/bench/pd.py: one engine against a producer + consumer pair, both through smg."""
    prompt: int = 4096              # about this many prompt tokens (plain words)
    decode_tokens: int = 128
    streams: list[int] = field(default_factory=lambda: [1, 8])
    reps: int = 3                   # interleaved rounds (single, PD) of each stream count
    kv_capacity: int = 64 * 1024    # every engine's: the largest round fits


@dataclass
class QuantPlan:
    """tools/bench/quant.py: bf16, FP8 and NVFP4 engines of each shape."""
    shapes: list[str] = field(default_factory=lambda: ["qwen3-8b", "qwen3-32b"])
    context: int = 512              # decode at this context, batch 1 and `streams`
    reps: int = 3                   # interleaved bf16 / format rounds of each figure
    streams: int = 8
    batch_tokens: int = 128
    prefill_P: int = 4096           # one chunk of P tokens
    kv_capacity: int = 8192
    seed_shape: str = "qwen3-32b"   # the seed's one-GPU deployment: this shape in NVFP4, int8 KV, 192k ("" = not run)
    formats: list[str] = field(default_factory=lambda: ["bf16", "fp8", "nvfp4", "w4a16", "fp16"])
    decode_only: bool = False       # decode batch 1 only (no batch 8, no prefill): an A/B of the decode step
    mtp_k: int = 3                  # NVFP4 with this many drafts against NVFP4 at k = 0, first shape (0 = not run)


@dataclass
class HybridPlan:
    """tools/bench/hybrid.py: the Qwen3.5-class shape on one engine (the seed's deployment)."""
    shape: str = "qwen3.5-27b"
    tensor_parallel_size: int = 2
    kv_dtype: str = "int8"
    decode_contexts: list[int] = field(default_factory=lambda: [512, 8 * K, 128 * K])
    decode_tokens: int = 128
    decode_reps: int = 3                         # at the first decode context (the headline's)
    prefill_prompts: list[int] = field(default_factory=lambda: [4 * K, 32 * K])
    long_context: int = 192 * K                  # prompt + decoded tokens
    long_decode_tokens: int = 512
    chunk: int = 4096
    one_gpu_format: str = "nvfp4"                # the quantized one-GPU deployment ("" = not run)
    deployments: tuple[str, ...] = ("tp", "one_gpu")


@dataclass
class StructuredPlan:
    """tools/bench/structured.py: a JSON-schema mask fill per step against an unconstrained step."""
    batches: list[int] = field(default_factory=lambda: [1, 32])
    context: int = 512
    decode_tokens: int = 64
    walks: int = 32                              # schema-valid sequences the matchers walk along
    walk_tokens: int = 160
    tokenizer: str = ""                          # a directory with tokenizer.json ("" = the small trained model)


@dataclass
class MoEPlan:
    """tools/bench/moe.py: the mixture-of-experts shape, decode batch 1 (TP1, and TP2 where two GPUs)."""
    shape: str = "qwen3-30b-a3b"
    context: int = 512
    reps: int = 3
    kv_capacity: int = 4096
    chunk: int = 4096


@dataclass
class Plan:
    mode: str
    shape: str
    chunk: int                      # the shared engine's prefill chunk (prefill's last, decode, concurrency)
    kv_capacity: int                # of every engine of the main shape: the largest request fits
    budgets: dict[str, float]
    global_s: float
    roofline: RooflinePlan
    peer: PeerPlan
    prefill: PrefillPlan
    decode: DecodePlan
    concurrency: ConcurrencyPlan
    kv: KVPlan
    tp: TPPlan
    acceptance: AcceptancePlan
    e2e: E2EPlan
    # The points the headline figures read (P=4096 and 32768 at chunk 4096, decode at a
    # 512-token context, int8 KV at 32768); the CPU dry run reads its own small stand-ins.
    reference: dict[str, int] = field(default_factory=lambda: dict(
        prefill_P=4096, prefill_long_P=32768, prefill_chunk=4096, decode_context=512, kv_context=32768,
        streams_small=2, streams_large=8, tp_prefill_P=512))
    quant: QuantPlan = field(default_factory=QuantPlan)
    hybrid: HybridPlan = field(default_factory=HybridPlan)
    structured: StructuredPlan = field(default_factory=StructuredPlan)
    moe: MoEPlan = field(default_factory=MoEPlan)
    pd: PDPlan = field(default_factory=PDPlan)


def make_plan(device: str, shape: str, quick: bool, repeats: int | None = None, time_scale: float = 1.0) -> Plan:
    plan = _cpu(shape, quick) if device == "cpu" else (_gpu_quick(shape) if quick else _gpu_full(shape))
    if repeats is not None:
        plan.prefill.repeats = {p: repeats for p in plan.prefill.repeats}
        plan.decode.repeats = {c: repeats for c in plan.decode.repeats}
        plan.kv.repeats = plan.tp.reps = plan.decode.pair_reps = plan.concurrency.reps = repeats
        plan.peer.reps = plan.quant.reps = plan.e2e.reps = plan.moe.reps = plan.hybrid.decode_reps = repeats
    if time_scale != 1.0:
        plan.budgets = {k: v * time_scale for k, v in plan.budgets.items()}
        plan.global_s *= time_scale
    return plan


def _gpu_full(shape: str) -> Plan:
    long = [2 * K, 4 * K, 8 * K, 32 * K]
    return Plan(
        mode="full", shape=shape, chunk=4096, kv_capacity=131 * K + 512,
        # peer: the compiled step's compile and autotuning (minutes) before its pairs; decode, kv, quant, e2e:
        # two engines held and interleaved (each round measures both)
        budgets={"roofline": 20, "peer": 420, "prefill": 150, "concurrency": 90, "decode": 240, "kv": 90,
                 "tp": 360, "acceptance": 45, "e2e": 600, "quant": 420, "hybrid": 360, "moe": 180, "pd": 300},
        global_s=2400,
        roofline=RooflinePlan(copy_bytes=2 << 30, matmul_n=8192, matmul_dtype="bfloat16",
                              gemv_rows=151936, gemv_cols=4096),
        peer=PeerPlan(prefill_prompts=[4 * K, 32 * K], reps=3, decode_prompt=512, decode_new_tokens=32,
                      compiled_tokens=256),
        prefill=PrefillPlan(grid={1024: long, 2048: long, 4096: long + [64 * K, 128 * K]},
                            repeats={2 * K: 3, 4 * K: 3, 8 * K: 3, 32 * K: 3, 64 * K: 1, 128 * K: 1}),
        decode=DecodePlan(ks=[0, 1, 2, 3, 5], contexts={k: [512, 8 * K, 32 * K] for k in (0, 1, 2, 3, 5)},
                          repeats={512: 3, 8 * K: 1, 32 * K: 1}, draft_vocab=32768, draft_vocab_ks=[1, 2, 3, 5],
                          target_decode_s=1.0, min_tokens=128, max_tokens=256),
        concurrency=ConcurrencyPlan(streams=[1, 2, 4, 8], context=512, target_decode_s=2.0, min_tokens=128,
                                    max_tokens=1024, interference_prompt=32 * K),
        kv=KVPlan(contexts=[8 * K, 32 * K], repeats=3),
        tp=TPPlan(context=512, reps=3, long_context=192 * K, long_decode_tokens=512, big_shape="qwen3-32b",
                  prefill_prompts=[512, 4 * K, 32 * K]),
        acceptance=AcceptancePlan(ks=[1, 2, 3, 5], temperatures=[0.0, 0.7], prompts_per_workload=3, max_tokens=192,
                                  implied_context=512),
        e2e=E2EPlan(prompt=512, decode_tokens=256, streams=[1, 8, 32], ttft_samples=32, reps=3, tps=[1, 2], ks=[0, 3],
                    draft_vocab=32768, kv_capacity=32 * K),
    )


def _gpu_quick(shape: str) -> Plan:
    plan = _gpu_full(shape)
    plan.mode = "quick"
    plan.kv_capacity = 32 * K + 1024
    # kv: the int8 engine's build and warm-up alone took 20-28 s on the H200 (graphs to 32k), so 25 s left its point
    # unmeasured (bench/results/2026-12-02-h200-fused-merge-kv-32b/e); 45 s holds it and one 32k point
    plan.budgets = {"roofline": 12, "peer": 360, "prefill": 45, "concurrency": 45, "decode": 90, "kv": 70,
                    "tp": 240, "acceptance": 25, "e2e": 480, "quant": 330, "hybrid": 300, "moe": 150, "pd": 240}
    plan.global_s = 1800            # a device call is shorter: pick sections, and --budget-s under the call's limit
    plan.e2e = E2EPlan(prompt=512, decode_tokens=128, streams=[1, 8, 32], ttft_samples=32, reps=3, tps=[1, 2],
                       ks=[0, 3], draft_vocab=32768, kv_capacity=24 * K)
    plan.roofline.repeats = 10
    plan.prefill = PrefillPlan(grid={4096: [4 * K, 32 * K]}, repeats={4 * K: 3, 32 * K: 3})
    plan.decode = DecodePlan(ks=[0, 1, 3], contexts={0: [512, 32 * K], 1: [512], 3: [512]},
                             repeats={512: 3, 32 * K: 1}, draft_vocab=32768, draft_vocab_ks=[1, 3],
                             target_decode_s=0.8, min_tokens=64, max_tokens=256)
    plan.concurrency = ConcurrencyPlan(streams=[1, 2, 8], context=512, target_decode_s=1.0, min_tokens=64,
                                       max_tokens=512, interference_prompt=16 * K)
    plan.kv = KVPlan(contexts=[32 * K], repeats=3)
    plan.acceptance = AcceptancePlan(ks=[3], temperatures=[0.0, 0.7], prompts_per_workload=2, max_tokens=128,
                                     implied_context=512)
    return plan


def _cpu(shape: str, quick: bool) -> Plan:
    plan = Plan(
        mode="cpu-quick" if quick else "cpu", shape=shape, chunk=128, kv_capacity=1024,
        # generous: the CPU run checks code paths (the test), it must not skip points on a slow machine
        budgets={name: 120.0 for name in ("roofline", "peer", "prefill", "concurrency", "decode", "kv", "tp",
                                          "acceptance", "e2e", "quant", "hybrid", "moe", "pd")},
        global_s=900,
        roofline=RooflinePlan(copy_bytes=64 << 20, matmul_n=512, matmul_dtype="float32", gemv_rows=4096,
                              gemv_cols=1024, repeats=5),
        peer=PeerPlan(prefill_prompts=[128, 512], reps=3, decode_prompt=64, decode_new_tokens=8, compiled_tokens=8),
        prefill=PrefillPlan(grid={64: [128, 512], 128: [128, 512]}, repeats={128: 3, 512: 3}),
        decode=DecodePlan(ks=[0, 1, 3], contexts={0: [64, 256], 1: [64, 256], 3: [64, 256]},
                          repeats={64: 3, 256: 1}, draft_vocab=128, draft_vocab_ks=[3],
                          target_decode_s=0.2, min_tokens=8, max_tokens=16),
        concurrency=ConcurrencyPlan(streams=[1, 2, 4], context=64, target_decode_s=0.1, min_tokens=8,
                                    max_tokens=32, interference_prompt=512, burst_prompt=96, burst_repeats=3),
        kv=KVPlan(contexts=[256], repeats=3),
        tp=TPPlan(context=64, reps=3, long_context=1024, long_decode_tokens=16, big_shape="tiny",
                  prefill_prompts=[128, 512], streams=4),
        acceptance=AcceptancePlan(ks=[3], temperatures=[0.0, 0.7], prompts_per_workload=1, max_tokens=24,
                                  implied_context=64),
        e2e=E2EPlan(prompt=64, decode_tokens=16, streams=[1, 2, 4], ttft_samples=32, reps=3, tps=[1], ks=[0, 3],
                    draft_vocab=128, kv_capacity=1024),
        reference=dict(prefill_P=128, prefill_long_P=512, prefill_chunk=128, decode_context=64, kv_context=256,
                       streams_small=2, streams_large=4, tp_prefill_P=512),
    )
    plan.quant = QuantPlan(shapes=["tiny"], context=64, streams=4, batch_tokens=8, prefill_P=128, kv_capacity=1024,
                           seed_shape="tiny")
    plan.hybrid = HybridPlan(shape="tiny-hybrid", decode_contexts=[64, 256], decode_tokens=8, prefill_prompts=[128, 512],
                             long_context=1024, long_decode_tokens=16, chunk=128)
    plan.structured = StructuredPlan(context=16, decode_tokens=12, walks=4, walk_tokens=80)
    plan.moe = MoEPlan(shape="tiny-moe", context=64, kv_capacity=1024, chunk=128)
    plan.pd = PDPlan(prompt=512, decode_tokens=16, streams=[1, 8], reps=3, kv_capacity=8 * 1024)
    plan.budgets["pd"] = 900.0      # three engine processes and two routers on a shared CPU
    if quick:                       # the test's run: every code path once, few engines
        plan.prefill = PrefillPlan(grid={128: [128, 512]}, repeats={128: 3, 512: 3})
        plan.decode.ks = [0, 3]
        plan.decode.contexts = {0: [64, 256], 3: [64]}
        plan.concurrency.streams = [1, 2, 4]
        plan.acceptance.max_tokens = 16
        plan.e2e.ks, plan.e2e.streams, plan.e2e.decode_tokens = [0], [1, 2], 8
    return plan
