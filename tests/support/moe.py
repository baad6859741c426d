"""Tiny random mixture-of-experts Qwen checkpoints written from transformers' own models (float32, eager
attention and eager experts, so that transformers is the reference), in each layout a producer writes:

- "transformers": `save_pretrained` output -- per-expert expert tensors (`experts.{e}.gate_proj.weight`, ...),
  Qwen3-Next's grouped in_proj_qkvz / in_proj_ba, `num_local_experts` for qwen3_moe;
- "fused": the in-memory state dict as is -- stacked `experts.gate_up_proj [E, 2I, H]` / `experts.down_proj [E, H, I]`;
- "published" (qwen3_5_moe): Qwen/Qwen3.5-*-A*B's layout -- a nested `qwen3_5_moe` config, the language model
  under `model.language_model.`, fused experts in the main layers and per-expert ones in the MTP layer.

The hybrids get a random MTP layer (`mtp.*`, per-expert experts: transformers has no MTP module and ignores
them). Router weights have a wide spread (std 3 / sqrt(H)), so top-k margins are rarely near a tie.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

# Shapes shared by the three architectures: vocabulary of the embedded tokenizer (384), 8 experts, top 2.
COMMON = dict(vocab_size=384, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              rms_norm_eps=1e-6, max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=0,
              eos_token_id=0, pad_token_id=0, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
HYBRID = dict(linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=24, linear_num_key_heads=2,
              linear_num_value_heads=4, shared_expert_intermediate_size=48, num_hidden_layers=4,
              layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"])

ARCHS = {
    # three layers: layer 1 dense (mlp_only_layers), no renormalisation of the top k
    "qwen3_moe": dict(COMMON, num_hidden_layers=3, intermediate_size=96, norm_topk_prob=False, decoder_sparse_step=1,
                      mlp_only_layers=[1], rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    # layer 0 dense; the MTP layer is sparse regardless
    "qwen3_next": dict(COMMON, **HYBRID, intermediate_size=96, norm_topk_prob=True, decoder_sparse_step=1,
                       mlp_only_layers=[0],
                       rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.25}),
    "qwen3_5_moe": dict(COMMON, **HYBRID, mtp_num_hidden_layers=1,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                         "mrope_section": [11, 11, 10], "mrope_interleaved": True}),
}
MTP_ARCHS = ("qwen3_next", "qwen3_5_moe")


def _classes(arch: str):
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        return Qwen3MoeConfig, Qwen3MoeForCausalLM
    if arch == "qwen3_next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
        return Qwen3NextConfig, Qwen3NextForCausalLM
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    return Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM


def _randomize(model, gen: torch.Generator, zero_centred: bool) -> None:
    """O(1) activations; norms around their base (1, or 0 for zero-centred ones) so a misplaced one shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):                                  # router: wide logits
                p.copy_(torch.randn(p.shape, generator=gen) * 3.0 / math.sqrt(p.shape[-1]))
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 15 + 1))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:
                base = 1.0 if (not zero_centred or name.endswith("linear_attn.norm.weight")) else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=gen))
            else:                                                                 # [.., out, in]: fan-in = in
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))


def _mtp_tensors(cfg, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One MTP layer in checkpoint layout: gated full attention and a sparse MoE block with a shared expert."""
    h, e, i, si = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    lin = lambda o, n: torch.randn(o, n, generator=gen) / math.sqrt(n)  # noqa: E731
    zc = lambda n: 0.2 * torch.randn(n, generator=gen)                   # noqa: E731
    p = "mtp.layers.0."
    sd = {"mtp.fc.weight": lin(h, 2 * h), "mtp.pre_fc_norm_embedding.weight": zc(h),
          "mtp.pre_fc_norm_hidden.weight": zc(h), "mtp.norm.weight": zc(h),
          p + "input_layernorm.weight": zc(h), p + "post_attention_layernorm.weight": zc(h),
          p + "self_attn.q_proj.weight": lin(2 * nh * d, h), p + "self_attn.k_proj.weight": lin(nkv * d, h),
          p + "self_attn.v_proj.weight": lin(nkv * d, h), p + "self_attn.o_proj.weight": lin(h, nh * d),
          p + "self_attn.q_norm.weight": zc(d), p + "self_attn.k_norm.weight": zc(d),
          p + "mlp.gate.weight": torch.randn(e, h, generator=gen) * 3.0 / math.sqrt(h),
          p + "mlp.shared_expert.gate_proj.weight": lin(si, h), p + "mlp.shared_expert.up_proj.weight": lin(si, h),
          p + "mlp.shared_expert.down_proj.weight": lin(h, si), p + "mlp.shared_expert_gate.weight": lin(1, h)}
    for x in range(e):
        sd[f"{p}mlp.experts.{x}.gate_proj.weight"] = lin(i, h)
        sd[f"{p}mlp.experts.{x}.up_proj.weight"] = lin(i, h)
        sd[f"{p}mlp.experts.{x}.down_proj.weight"] = lin(h, i)
    return sd


def build_reference(arch: str, seed: int = 0, echo_mtp: float = 0.0, **overrides):
    """(transformers model in float32 with eager attention and experts, its random MTP tensors or {}).

    `echo_mtp` > 0: a model whose drafts are often right, so that speculation both accepts and rejects --
    lm_head = embed_tokens + echo_mtp x noise (the model tends to repeat a token, more so for small values),
    and the MTP fc passes the normed embedding of the token it is fed through (u = e + W h), so its draft
    leans to repeating that token. Around 1.2, a third of the drafts are accepted."""
    config_cls, model_cls = _classes(arch)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**ARCHS[arch], **overrides}))
    model.set_attn_implementation("eager")
    model.set_experts_implementation("eager")
    _randomize(model, gen, zero_centred=arch != "qwen3_moe")
    model = model.float().eval()
    mtp = _mtp_tensors(model.config, gen) if arch in MTP_ARCHS else {}
    if echo_mtp > 0:
        h = model.config.hidden_size
        with torch.no_grad():
            model.lm_head.weight.copy_(model.model.embed_tokens.weight
                                       + echo_mtp * torch.randn(model.lm_head.weight.shape, generator=gen))
        if mtp:
            mtp["mtp.fc.weight"] = torch.cat([torch.eye(h), mtp["mtp.fc.weight"][:, h:]], 1)
    return model, mtp


def _finish_dir(path: Path) -> None:
    from engine.loading.embedded_model import build_default_tokenizer
    build_default_tokenizer().inner.save(str(path / "tokenizer.json"))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 0}))


def _read(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open
    with safe_open(path / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def write_checkpoint(model, mtp: dict[str, torch.Tensor], path: Path, layout: str = "transformers",
                     with_mtp: bool = True) -> Path:
    """Write `model` (+ `mtp`) to `path` in `layout` ("transformers", "fused" or "published")."""
    from safetensors.torch import save_file
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    extra = mtp if with_mtp else {}
    if layout == "transformers":
        tensors = _read(path)
    elif layout == "fused":
        tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    elif layout == "published":
        tensors = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v.contiguous()
                   for k, v in model.state_dict().items()}
        text = json.loads((path / "config.json").read_text())
        for k in ("architectures", "transformers_version", "dtype"):
            text.pop(k, None)
        (path / "config.json").write_text(json.dumps({
            "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "text_config": text, "tie_word_embeddings": text.get("tie_word_embeddings", False)}, indent=2))
    else:
        raise ValueError(f"unknown layout {layout!r}")
    (path / "model.safetensors").unlink()
    save_file({**tensors, **extra}, str(path / "model.safetensors"), metadata={"format": "pt"})
    _finish_dir(path)
    return path


def build_random_moe(path: Path, arch: str, seed: int = 0, layout: str = "transformers", with_mtp: bool = True,
                     echo_mtp: float = 0.0, **overrides):
    """A random `arch` checkpoint at `path`; returns (transformers model, its MTP tensors)."""
    model, mtp = build_reference(arch, seed, echo_mtp, **overrides)
    write_checkpoint(model, mtp, path, layout, with_mtp)
    return model, mtp
