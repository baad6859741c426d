"""The MTP layer of the MoE hybrids (Qwen3-Next, Qwen3.5-MoE): a gated full-attention layer whose MLP is a
sparse MoE block with a shared expert.

- The engine's MTP hidden states over a prefill equal a reference built from transformers' own decoder-layer
  class of the architecture (full attention, the sparse block) and the checkpoint's raw `mtp.*` tensors:
      u_t = fc(concat(pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)));  g = norm(layer(u))
- Speculation is lossless: greedy with k = 3 (and 1) drafts equals k = 0 token for token over a batch of
  prompts prefilled in chunks of 16, and every KV block and state slot is returned. The checkpoints lean to
  repeating tokens and their MTP to echoing its input (tests/support/moe.py `echo_mtp`), so rounds accept
  some drafts and reject others: the linear-attention states commit partial verify windows.
"""

from __future__ import annotations

import copy

import pytest
import torch

from engine import SamplingParams
from tests.conftest import assert_kv_idle, make_llm, runner_of
from tests.engine.models.test_qwen3_vs_transformers import random_prompts
from tests.support.moe import MTP_ARCHS, build_random_moe

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


@pytest.fixture(scope="module", params=MTP_ARCHS)
def moe(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf, mtp = build_random_moe(path, request.param, seed=3, echo_mtp=1.2)      # drafts accepted and rejected
    return request.param, str(path), hf, mtp


class MTPReference(torch.nn.Module):
    """The MTP module from transformers' decoder-layer and norm classes of the architecture."""

    def __init__(self, arch: str, hf, mtp: dict[str, torch.Tensor]):
        super().__init__()
        if arch == "qwen3_next":
            from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer as Layer
            from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm as Norm
        else:
            from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer as Layer
            from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm as Norm
        cfg = copy.deepcopy(hf.config)
        cfg.layer_types, cfg.num_hidden_layers = ["full_attention"], 1
        if arch == "qwen3_next":
            cfg.mlp_only_layers, cfg.decoder_sparse_step = [], 1
        h, e = cfg.hidden_size, cfg.num_experts
        self.hf = hf
        self.norms = {n: Norm(h, eps=cfg.rms_norm_eps) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
        for n, norm in self.norms.items():
            norm.weight.data.copy_(mtp[f"mtp.{n}.weight"])
        self.fc = mtp["mtp.fc.weight"]
        self.layer = Layer(cfg, 0).float().eval()
        p = "mtp.layers.0."
        sd = {n[len(p):]: t for n, t in mtp.items() if n.startswith(p) and ".experts." not in n}
        sd["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([mtp[f"{p}mlp.experts.{x}.gate_proj.weight"],
                                                                 mtp[f"{p}mlp.experts.{x}.up_proj.weight"]]) for x in range(e)])
        sd["mlp.experts.down_proj"] = torch.stack([mtp[f"{p}mlp.experts.{x}.down_proj.weight"] for x in range(e)])
        self.layer.load_state_dict(sd, strict=True)

    @torch.no_grad()
    def g(self, ids: list[int]) -> torch.Tensor:
        """g_t for t = 0 .. len(ids) - 2 (teacher-forced: x_{t+1} is the prompt's next token)."""
        x = torch.tensor([ids])
        h = self.hf.model(input_ids=x).last_hidden_state                             # final-normed
        emb = self.norms["pre_fc_norm_embedding"](self.hf.model.embed_tokens(x[:, 1:]))
        u = torch.cat([emb, self.norms["pre_fc_norm_hidden"](h[:, :-1])], -1) @ self.fc.T
        t = u.shape[1]
        pos = torch.arange(t).unsqueeze(0)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        out = self.layer(u, position_embeddings=self.hf.model.rotary_emb(u, pos), attention_mask=mask, position_ids=pos)
        out = out[0] if isinstance(out, tuple) else out
        return self.norms["norm"](out)[0]


def test_prefill_mtp_states_match_transformers_layers(moe):
    arch, path, hf, mtp = moe
    llm = make_llm(path, draft_tokens=1, prefill_chunk=16)
    model = runner_of(llm.engine).model
    calls = []
    hook = model.mtp.register_forward_hook(lambda m, args, out: calls.append((args[2].clone(), out.detach().clone())))
    ids = random_prompts(hf.config.vocab_size, [40], seed=6)[0]
    try:
        llm.generate([ids], SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0))
    finally:
        hook.remove()
    positions = torch.cat([c[0] for c in calls])
    g = torch.cat([c[1] for c in calls])
    assert positions[:len(ids) - 1].tolist() == list(range(len(ids) - 1))            # the prefill's chunks
    ref = MTPReference(arch, hf, mtp).g(ids)
    err = float(((g[:len(ids) - 1] - ref).norm(dim=-1) / ref.norm(dim=-1)).max())
    print(f"\n{arch}: MTP g over a 40-token prefill (chunks of 16), max relative error {err:.2e}")
    assert err < 1e-4


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_with_drafts_equals_k0(moe, k):
    arch, path, hf, _ = moe
    prompts = random_prompts(hf.config.vocab_size, [5, 19, 40, 64], seed=7)
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    want = [o.token_ids for o in make_llm(path, prefill_chunk=16).generate(prompts, params)]
    llm = make_llm(path, prefill_chunk=16, draft_tokens=k)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    spec = [o.stats.speculative for o in outs]
    drafted, accepted = sum(s.drafted for s in spec), sum(s.accepted for s in spec)
    assert drafted > accepted > 0
    print(f"\n{arch} k={k}: drafted {sum(s.drafted for s in spec)}, accepted {sum(s.accepted for s in spec)}")
    assert_kv_idle(llm.engine)
