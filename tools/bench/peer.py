"""The peers, each interleaved with the engine in the same run: Hugging Face transformers at the same
shape and precision, and the decode step written as gpt-fast runs it (`tools.bench.compiled_peer`).

The engine is the shared k = 0 engine of the plan's chunk (the one the later sections reuse). Each
comparison runs engine, peer, engine, peer, ... for `reps` rounds (`tools.bench.interleave`); the
headline keys are the medians of the per-rep ratios (derive.py):

- prefill (`prefill_pairs`): at each P, a fresh P-token prompt through the engine (max_tokens = 1, its
  own `prefill_tok_s`) against transformers' forward over a fresh prompt (sdpa attention, no KV cache
  kept, the logits of the last position only, `logits_to_keep=1`, what `generate()` computes for a
  prompt): `prefill_4k_vs_transformers`, `prefill_32k_vs_transformers`;
- decode (`compiled_decode_pair`): batch 1 at the reference context, n tokens of the engine's
  request (its own decode timing) against n steps of the compiled peer (wall time, one CUDA graph per
  step): `decode_b1_over_compiled_peer` = peer ms per token / engine ms per token;
- transformers' `generate()` batch 1, greedy, eager, dynamic cache, for the record (not a headline):
  tok/s = n / (t(1 + n new) - t(1 new)), so the prompt's forward cancels out.

The transformers model is built directly on the device with its weight initialisation switched off
(`no_init_weights`), then filled in place (matrices ~ N(0, 1/fan_in), norms = 1, like the engine's
random weights). On the CPU (the dry run) the compiled peer runs eagerly: no figure.
"""

from __future__ import annotations

import contextlib
import gc
import time

import torch

from engine.config import ModelConfig
from engine.sampling_params import SamplingParams
from engine.worker.model_runner import default_dtype
from tools.bench import compiled_peer, interleave
from tools.bench.plan import PeerPlan
from tools.bench.progress import fmt_rate, say
from tools.bench.session import compact, random_prompt
from tools.bench.timing import summary, wall

COMPILE_GUESS_S = {"cuda": 240.0, "cpu": 5.0}     # the whole step compiled with autotuning, before it is measured


def _no_init():
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        try:
            from transformers.modeling_utils import no_init_weights
        except ImportError:
            return contextlib.nullcontext()
    return no_init_weights()


def build(cfg: ModelConfig, device: str, dtype: torch.dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    hf = Qwen3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=False, hidden_act="silu",
        attn_implementation="sdpa", use_cache=True, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    with _no_init(), default_dtype(dtype), torch.device(device):
        model = Qwen3ForCausalLM(hf)
    gen = torch.Generator(device).manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
    model.eval()
    return model


def engine_prefill(session, P: int, timeout: float) -> dict:
    r = compact(session.generate(random_prompt(P, session.vocab), SamplingParams(max_tokens=1, temperature=0.0), timeout=timeout))
    return {"prefill_tok_s": r["prefill_tok_s"], "computed_prefill_tokens": r["computed_prefill_tokens"],
            "cached_tokens": r["cached_tokens"], "prefill_s": r["prefill_s"]}


def engine_decode(session, context: int, tokens: int, timeout: float) -> dict:
    r = compact(session.generate(random_prompt(context, session.vocab),
                                 SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0), timeout=timeout))
    return {"ms_per_token": r["decode_s"] / (r["completion_tokens"] - 1) * 1e3, "completion_tokens": r["completion_tokens"],
            "decode_s": r["decode_s"], "finish_reason": r["finish_reason"]}


def run(bench, sec: dict) -> None:
    plan: PeerPlan = bench.plan.peer
    dev, cfg = bench.device, bench.cfg
    dtype = torch.bfloat16 if dev != "cpu" else torch.float32
    session, reused = bench.pool.get(bench.engine_spec(draft_tokens=0), warm_prompt=plan.decode_prompt, warm_decode=32)
    say("peer", "engine " + ("reused" if reused else session.setup_text))
    sec["engine"] = session.describe
    sec["parts"] = list(plan.parts)
    if "transformers" in plan.parts:
        try:
            _transformers(bench, sec, plan, session, cfg, dev, dtype)
        finally:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    if "compiled" in plan.parts:
        _compiled(bench, sec, plan, session, cfg, dev, dtype)
    sec["status"] = "ok"


def _transformers(bench, sec: dict, plan: PeerPlan, session, cfg, dev: str, dtype) -> None:
    import transformers
    t0 = time.perf_counter()
    model = build(cfg, dev, dtype)
    build_s = time.perf_counter() - t0
    sec["setup"] = {"transformers": transformers.__version__, "attn_implementation": model.config._attn_implementation,
                    "dtype": str(dtype).removeprefix("torch."), "build_s": round(build_s, 2),
                    "prefill": "forward(use_cache=False, logits_to_keep=1)",
                    "decode": "generate(greedy, batch 1, eager, dynamic cache)"}
    say("peer", f"transformers {transformers.__version__} model built in {build_s:.1f} s "
                f"({sec['setup']['attn_implementation']}, {sec['setup']['dtype']})")

    def forward(ids):
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False, logits_to_keep=1)

    def ids_of(n):
        return torch.tensor([random_prompt(n, cfg.vocab_size)], device=dev)

    def hf_prefill(P):
        ids = ids_of(P)
        rate = P / wall(lambda: forward(ids), dev)
        bench.note_prefill_rate("peer", P, rate)
        return {"tok_s": rate}

    wall(lambda: forward(ids_of(min(plan.prefill_prompts))), dev)          # warm-up
    sec["prefill"], sec["prefill_pairs"] = [], []
    for P in plan.prefill_prompts:
        one = bench.estimate_prefill_s(P, "peer") + bench.estimate_prefill_s(P)
        if not bench.budget.allows(one * plan.reps):
            sec["prefill"].append({"P": P, "skipped": bench.budget.skip_reason(one * plan.reps)})
            say("peer", f"prefill P={P} skipped ({bench.budget.skip_reason(one * plan.reps)})")
            continue
        timeout = max(120.0, 10 * one)
        pair = interleave.run({"engine": lambda: engine_prefill(session, P, timeout), "transformers": lambda: hf_prefill(P)},
                              plan.reps, bench.budget, one, P=P, chunk=session.describe.get("prefill_chunk"),
                              tensor_parallel_size=session.describe.get("tensor_parallel_size", 1))
        sec["prefill_pairs"].append(pair)
        rates = [r["tok_s"] for r in pair["reps"]["transformers"]]
        s = summary(rates)
        sec["prefill"].append({"P": P, "tok_s_peak": s["peak"], "tok_s_median": s["median"], "repeats": rates})
        ratio = interleave.reduce_pair(pair, "engine", "transformers", "prefill_tok_s", metric_b="tok_s")
        say("peer", f"prefill P={P}: transformers {fmt_rate(s['median'])} median (MFU {bench.mfu_text(P, s['median'])}); "
                    f"engine / transformers {ratio['value'] or 0:.3f} ({ratio['rule']}, {ratio['reps']} reps)")
        bench.save()

    n = plan.decode_new_tokens
    prompt = ids_of(plan.decode_prompt)

    def gen_tokens(k):
        with torch.inference_mode():
            out = model.generate(prompt, max_new_tokens=k, min_new_tokens=k, do_sample=False, use_cache=True,
                                 pad_token_id=0)
        if out.shape[1] != prompt.shape[1] + k:
            raise RuntimeError(f"generate() returned {out.shape[1] - prompt.shape[1]} tokens, asked {k}")
    wall(lambda: gen_tokens(4), dev)                                          # warm-up
    est = 2 * n * bench.peer_decode_guess_s()
    if bench.budget.allows(est):
        t1 = min(wall(lambda: gen_tokens(1), dev) for _ in range(2))
        tn = wall(lambda: gen_tokens(1 + n), dev)
        rate = n / max(1e-9, tn - t1)
        sec["decode"] = {"prompt_tokens": plan.decode_prompt, "new_tokens": n, "t_first_s": t1,
                         "t_all_s": tn, "tok_s": rate, "ms_per_token": 1e3 / rate}
        say("peer", f"decode generate() b1: {fmt_rate(rate)} ({1e3 / rate:.1f} ms/token)")
    else:
        sec["decode"] = {"skipped": bench.budget.skip_reason(est)}


def _compiled(bench, sec: dict, plan: PeerPlan, session, cfg, dev: str, dtype) -> None:
    ctx, n = plan.decode_prompt, plan.compiled_tokens
    guess = COMPILE_GUESS_S[bench.kind]
    if not bench.budget.allows(guess):
        sec["compiled_decode"] = {"skipped": bench.budget.skip_reason(guess)}
        say("peer", f"compiled step skipped ({bench.budget.skip_reason(guess)})")
        return
    peer = None
    try:
        t0 = time.perf_counter()
        peer = compiled_peer.build(cfg, dev, dtype, max_len=ctx + n + 8, mode=plan.compiled_mode)
        setup_s = time.perf_counter() - t0
        timeout = max(120.0, n * 1.0)

        def peer_rep():
            return {"ms_per_token": peer.run(ctx, n) / n * 1e3}

        pair = interleave.run({"engine": lambda: engine_decode(session, ctx, n, timeout), "compiled_peer": peer_rep},
                              plan.reps, context=ctx, tokens=n,
                              tensor_parallel_size=session.describe.get("tensor_parallel_size", 1))
        ms = [r["ms_per_token"] for r in pair["reps"]["compiled_peer"]]
        sec["compiled_decode_pair"] = pair
        sec["compiled_decode"] = {"context": ctx, "new_tokens": n, "ms_per_token": ms,
                                  "ms_per_token_median": summary(ms)["median"], "setup_s": round(setup_s, 2),
                                  **peer.describe(),
                                  "note": None if dev != "cpu" else
                                  "CPU dry run: eager, uncompiled, no graph (a code-path check, not a figure)"}
        ratio = interleave.reduce_pair(pair, "compiled_peer", "engine", "ms_per_token")
        say("peer", f"compiled step b1 ({plan.compiled_mode if dev != 'cpu' else 'eager'}): "
                    f"{summary(ms)['median']:.2f} ms/token median (setup {setup_s:.1f} s); engine over it "
                    f"{ratio['value'] or 0:.3f} ({ratio['reps']} reps)")
    except Exception as e:  # noqa: BLE001 - the transformers figures above stand; the reason is kept
        sec["compiled_decode"] = {"error": f"{type(e).__name__}: {e}"[:600]}
        say("peer", f"compiled static-cache step: ERROR {sec['compiled_decode']['error'][:200]}")
    finally:
        peer = None  # noqa: F841 - its memory goes back before the next section's engines
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
