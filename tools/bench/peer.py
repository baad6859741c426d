"""The peer: Hugging Face transformers at the same shape and precision, random weights.

The model is built directly on the device in the engine's dtype with transformers' own weight
initialisation switched off (`no_init_weights`), then filled in place (matrices ~ N(0, 1/fan_in),
norms = 1, like the engine's random weights): seconds, not the minutes of a CPU init.

- prefill: one forward over a P-token prompt, sdpa attention, no KV cache kept, logits of the last
  position only (`logits_to_keep=1`, which is what `generate()` computes for a prompt too);
- decode: `generate()` batch 1, greedy, eager, dynamic cache; tok/s = n / (t(1 + n new) - t(1 new)),
  so the prompt's forward cancels out;
- compiled decode: the strong peer of `tools.bench.compiled_peer` (static cache, torch.compile, the
  step in one CUDA graph), batch 1 at the same context: headline `decode_b1_over_compiled_peer`.
"""

from __future__ import annotations

import contextlib
import gc
import time

import torch

from engine.config import ModelConfig
from engine.worker.model_runner import default_dtype
from tools.bench import compiled_peer
from tools.bench.plan import PeerPlan
from tools.bench.progress import fmt_rate, say
from tools.bench.session import random_prompt
from tools.bench.timing import summary, wall


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


def run(bench, sec: dict) -> None:
    plan: PeerPlan = bench.plan.peer
    dev, cfg = bench.device, bench.cfg
    dtype = torch.bfloat16 if dev != "cpu" else torch.float32
    import transformers
    model = None
    try:
        t0 = time.perf_counter()
        model = build(cfg, dev, dtype)
        build_s = time.perf_counter() - t0
        sec["setup"] = {"transformers": transformers.__version__, "attn_implementation": model.config._attn_implementation,
                        "dtype": str(dtype).removeprefix("torch."), "build_s": round(build_s, 2),
                        "prefill": "forward(use_cache=False, logits_to_keep=1)",
                        "decode": "generate(greedy, batch 1, eager, dynamic cache)"}
        say("peer", f"transformers {transformers.__version__} model built in {build_s:.1f} s "
                    f"({sec['setup']['attn_implementation']}, {sec['setup']['dtype']})")
        sec["prefill"] = []
        vocab = cfg.vocab_size

        def forward(ids):
            with torch.inference_mode():
                model(input_ids=ids, use_cache=False, logits_to_keep=1)

        def ids_of(n):
            return torch.tensor([random_prompt(n, vocab)], device=dev)

        wall(lambda: forward(ids_of(min(plan.prefill_prompts))), dev)          # warm-up
        for P in plan.prefill_prompts:
            est = bench.estimate_prefill_s(P, "peer") * (plan.prefill_repeats + 1)
            if not bench.budget.allows(est):
                sec["prefill"].append({"P": P, "skipped": bench.budget.skip_reason(est)})
                say("peer", f"prefill P={P} skipped ({bench.budget.skip_reason(est)})")
                continue
            rates = []
            for _ in range(plan.prefill_repeats):
                ids = ids_of(P)
                rates.append(P / wall(lambda: forward(ids), dev))
                bench.note_prefill_rate("peer", P, rates[-1])
            s = summary(rates)
            point = {"P": P, "tok_s_peak": s["peak"], "tok_s_median": s["median"], "repeats": rates}
            sec["prefill"].append(point)
            say("peer", f"prefill P={P}: {fmt_rate(s['peak'])} peak, {fmt_rate(s['median'])} median "
                        f"(MFU {bench.mfu_text(P, s['peak'])})")
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
            floor = bench.floor_ms(plan.decode_prompt + n / 2)
            frac = f", {floor * rate / 1e3:.2f} of the roofline" if floor else ""
            say("peer", f"decode generate() b1: {fmt_rate(rate)} ({1e3 / rate:.1f} ms/token{frac})")
        else:
            sec["decode"] = {"skipped": bench.budget.skip_reason(est)}
        model = None
        gc.collect()
        try:
            sec["compiled_decode"] = c = compiled_peer.measure(cfg, dev, dtype, plan.decode_prompt, max(n, 64))
            say("peer", f"compiled static-cache step b1 ({'torch.compile + one CUDA graph' if c['compiled'] else 'eager'}): "
                        f"{c['ms_per_token_best']:.2f} ms/token (setup {c['setup_s']:.1f} s)")
        except Exception as e:  # noqa: BLE001 - the transformers figures above stand; the reason is kept
            sec["compiled_decode"] = {"error": f"{type(e).__name__}: {e}"[:600]}
            say("peer", f"compiled static-cache step: ERROR {sec['compiled_decode']['error'][:200]}")
        sec["status"] = "ok"
    finally:
        model = None  # noqa: F841 - the last reference: its memory goes back before the engine runs
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

