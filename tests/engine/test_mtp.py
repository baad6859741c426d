"""The MTP draft head against an independent float32 recomputation of the model card's formulas.

The reference is built from transformers pieces and the raw `mtp.*` tensors (read with safetensors),
never from engine code:

    h_t = model.norm(last decoder layer output at t)                       (HF Qwen3Model)
    u_t = mtp.fc(concat(pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)))
    g_t = mtp.norm(Qwen3DecoderLayer[mtp.layers.0](u)_t)                   causal, RoPE position t
    d   = argmax(lm_head(g_t))                                             draft for x_{t+2}

and k drafts feed (g, d_j) at the next positions. It is compared with what the engine computes on its
real paths: the MTP entries its prefill writes, the first decode round's step 1, and, round by round,
the drafts it proposes (reconstructed from its acceptance counts, which must match exactly).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import WORKLOADS, make_llm, runner_of
from engine import SamplingParams

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


class MTPReference:
    def __init__(self, model_dir: str):
        from safetensors import safe_open
        from transformers import Qwen3ForCausalLM
        from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm

        self.hf = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                   attn_implementation="eager").eval()
        cfg = self.hf.config
        index = json.loads((Path(model_dir) / "model.safetensors.index.json").read_text())["weight_map"]
        mtp: dict[str, torch.Tensor] = {}
        for fname in sorted(set(index.values())):
            with safe_open(Path(model_dir) / fname, "pt") as f:
                for name in f.keys():
                    if name.startswith("mtp."):
                        mtp[name] = f.get_tensor(name).float()
        self.num_mtp_tensors = len(mtp)

        def norm(name: str) -> Qwen3RMSNorm:
            n = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
            n.weight.data.copy_(mtp[name])
            return n.eval()
        self.norm_emb = norm("mtp.pre_fc_norm_embedding.weight")
        self.norm_hidden = norm("mtp.pre_fc_norm_hidden.weight")
        self.norm_out = norm("mtp.norm.weight")
        self.fc = mtp["mtp.fc.weight"]                                           # [H, 2H]
        self.layer = Qwen3DecoderLayer(cfg, layer_idx=0).float().eval()
        prefix = "mtp.layers.0."
        self.layer.load_state_dict({n[len(prefix):]: t for n, t in mtp.items() if n.startswith(prefix)}, strict=True)
        self.embed = self.hf.model.embed_tokens.weight.detach()                  # tied lm_head

    @torch.no_grad()
    def target(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, H] (final-normed) and logits [T, V] of the target model."""
        captured = {}
        hook = self.hf.model.layers[-1].register_forward_hook(
            lambda m, i, o: captured.__setitem__("raw", o[0] if isinstance(o, tuple) else o))
        try:
            out = self.hf.model(torch.tensor([ids]), output_hidden_states=True)
        finally:
            hook.remove()
        h = self.hf.model.norm(captured["raw"])[0]
        # The card's h_t is model.norm(last layer output): that is last_hidden_state. (With
        # transformers 5, output_hidden_states' last element is that same normed tensor.)
        assert torch.equal(h, out.last_hidden_state[0])
        return h, self.hf.lm_head(h)

    @torch.no_grad()
    def u(self, hidden: torch.Tensor, next_ids: list[int]) -> torch.Tensor:
        e = self.norm_emb(self.embed[torch.tensor(next_ids)])
        return torch.cat([e, self.norm_hidden(hidden)], -1) @ self.fc.T

    @torch.no_grad()
    def g(self, u: torch.Tensor) -> torch.Tensor:
        """The MTP layer run causally over u [T, H] at positions 0..T-1 -> g [T, H]."""
        t = u.shape[0]
        pos = torch.arange(t).unsqueeze(0)
        cos_sin = self.hf.model.rotary_emb(u.unsqueeze(0), pos)
        mask = torch.full((t, t), torch.finfo(torch.float32).min).triu(1)[None, None]
        out = self.layer(u.unsqueeze(0), attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
        out = out[0] if isinstance(out, tuple) else out
        return self.norm_out(out[0])

    def draft(self, g_row: torch.Tensor) -> int:
        return int((g_row @ self.embed.T).argmax())

    def drafts_for_round(self, real_u: torch.Tensor, n: int, k: int) -> list[int]:
        """Greedy drafts of a round at n tokens: d_1 from g_{n-2} (real entries 0..n-2), then (g, d_j)
        fed at positions n-1, n, ..."""
        seq = real_u[:n - 1]
        g = self.g(seq)
        drafts = [self.draft(g[-1])]
        for _ in range(k - 1):
            step = self.u(g[-1:], drafts[-1:])
            seq = torch.cat([seq, step])
            g = self.g(seq)
            drafts.append(self.draft(g[-1]))
        return drafts


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest per-row relative L2 error of a against the reference b."""
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1)).max())


@pytest.fixture(scope="module")
def ref(shared_model) -> MTPReference:
    return MTPReference(shared_model)


class MTPCapture:
    """Records (positions, g) of every MTP-module call of an engine (a forward hook: observes only)."""

    def __init__(self, llm):
        self.calls: list[tuple[list[int], torch.Tensor]] = []
        self.target: list[torch.Tensor] = []
        model = runner_of(llm.engine).model
        self._hooks = [
            model.mtp.register_forward_hook(
                lambda m, args, out: self.calls.append((args[2].tolist(), out.detach().clone()))),
            model.model.register_forward_hook(lambda m, args, out: self.target.append(out.detach().clone())),
        ]

    def close(self):
        for h in self._hooks:
            h.remove()


def test_reference_reads_every_mtp_tensor(ref, shared_model):
    names = json.loads((Path(shared_model) / "model.safetensors.index.json").read_text())["weight_map"]
    assert ref.num_mtp_tensors == sum(n.startswith("mtp.") for n in names) == 4 + 11


def test_prefill_and_first_round_match_reference(ref, shared_model):
    """The MTP entries the engine's prefill computes (positions 0..P-2) and the first round's step 1
    (position P-1, fed the sampled token) equal the reference g; so does the first draft token."""
    llm = make_llm(shared_model, draft_tokens=1)
    prompt = WORKLOADS["code"][0]
    ids = llm.tokenizer.encode(prompt)
    cap = MTPCapture(llm)
    try:
        out = llm.generate([ids], SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0))[0]
    finally:
        cap.close()
    p = len(ids)
    x = ids + out.token_ids
    h_ref, logits_ref = ref.target(x)
    # the target hidden states of the prefill (that the MTP consumes) match transformers
    target_err = rel_err(cap.target[0], h_ref[:p])
    assert out.token_ids[0] == int(logits_ref[p - 1].argmax())
    g_ref = ref.g(ref.u(h_ref[:-1], x[1:]))                                   # g_0 .. g_{len(x)-2}
    prefill_positions, prefill_g = cap.calls[0]
    assert prefill_positions == list(range(p))
    prefill_err = rel_err(prefill_g[:p - 1], g_ref[:p - 1])
    step1_positions, step1_g = cap.calls[1]                                     # round 1, step 1
    assert step1_positions == [p - 1, p]                                        # k+1 slots, first is real
    step1_err = rel_err(step1_g[:1], g_ref[p - 1:p])
    engine_logits = runner_of(llm.engine).model.compute_logits(step1_g[:1])
    draft_logit_err = rel_err(engine_logits, g_ref[p - 1:p] @ ref.embed.T)
    print(f"\nMTP vs reference (P={p}): target hidden rel err {target_err:.2e}, prefill g rel err "
          f"{prefill_err:.2e}, round-1 g rel err {step1_err:.2e}, draft logits rel err {draft_logit_err:.2e}")
    assert target_err <= 1e-4
    assert prefill_err <= 1e-4
    assert step1_err <= 1e-4
    assert draft_logit_err <= 1e-4
    # the engine's first draft (d_1 for x_{P+1}) is the reference's, and so is its verdict
    d1 = ref.draft(g_ref[p - 1])
    assert int(engine_logits.argmax()) == d1
    spec = out.stats.speculative
    assert spec.rounds == 1 and spec.accepted_per_position == (int(d1 == x[p + 1]),)


@pytest.mark.parametrize("k", [1, 3])
def test_round_by_round_drafts_match_reference(ref, shared_model, k):
    """Greedy generation with k drafts: replaying the rounds with the reference's drafts gives exactly
    the engine's rounds and per-position acceptance counts (a draft off by one position, an unnormed
    hidden state or a stale MTP cache entry would change them), over prompts of several workloads."""
    llm = make_llm(shared_model, draft_tokens=k)
    prompts = [WORKLOADS["json"][1], WORKLOADS["code"][1], WORKLOADS["prose"][0]]
    max_tokens = 40
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
    for prompt, out in zip(prompts, outs):
        ids = llm.tokenizer.encode(prompt)
        x = ids + out.token_ids
        h_ref, logits_ref = ref.target(x)
        # greedy output equals the target's teacher-forced argmax
        assert out.token_ids == logits_ref[len(ids) - 1:-1].argmax(-1).tolist()
        real_u = ref.u(h_ref[:-1], x[1:])                                      # u_0 .. u_{len(x)-2}
        n, rounds, per_pos = len(ids) + 1, 0, [0] * k
        while n - len(ids) < max_tokens:
            drafts = ref.drafts_for_round(real_u, n, k)
            accepted = 0
            while accepted < k and n + accepted < len(x) and drafts[accepted] == x[n + accepted]:
                accepted += 1
            if n + accepted >= len(x):       # the run ended inside this round: the engine knew more
                break
            rounds += 1
            for i in range(accepted):
                per_pos[i] += 1
            n += accepted + 1
        spec = out.stats.speculative
        if n - len(ids) >= max_tokens:
            assert (spec.rounds, list(spec.accepted_per_position)) == (rounds, per_pos), prompt
        else:
            # the last round ran past the generated tokens: its first `accepted` drafts matched, the
            # rest are unknown here; every earlier round must agree exactly
            assert spec.rounds == rounds + 1, prompt
            extra = [e - r for e, r in zip(spec.accepted_per_position, per_pos)]
            assert extra[:accepted] == [1] * accepted, prompt
            assert all(v in (0, 1) for v in extra) and extra == sorted(extra, reverse=True), prompt
        assert spec.rounds >= 1 and sum(spec.accepted_per_position) >= 1
