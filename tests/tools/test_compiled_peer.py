"""The bench's compiled decode peer (tools/bench/compiled_peer.py) computes the real Qwen3 step: with
the same weights, its greedy tokens equal Hugging Face transformers' (the reference allowed in tests).
On the CPU the step runs eagerly; on a GPU the very same functions are compiled and graphed."""

from __future__ import annotations

import torch

from engine.loading.presets import preset
from tools.bench.compiled_peer import CompiledDecodePeer


def test_the_peer_step_generates_what_transformers_generates():
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = preset("tiny")
    peer = CompiledDecodePeer(cfg, "cpu", torch.float32, max_len=48, compile=False)
    gen = torch.Generator().manual_seed(3)
    for w in peer.layers:                                 # norms other than ones: their code is checked too
        for name in ("in_norm", "post_norm", "q_norm", "k_norm"):
            w[name] = 1 + 0.2 * torch.randn(w[name].shape, generator=gen)
    peer.final_norm = 1 + 0.2 * torch.randn(peer.final_norm.shape, generator=gen)
    hf = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=64, tie_word_embeddings=False,
        attention_bias=False, attn_implementation="eager")).eval()
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(peer.embed)
        hf.model.norm.weight.copy_(peer.final_norm)
        hf.lm_head.weight.copy_(peer.lm_head)
        for layer, w in zip(hf.model.layers, peer.layers):
            a, m = layer.self_attn, layer.mlp
            for dst, src in ((a.q_proj, w["qkv"][:q]), (a.k_proj, w["qkv"][q:q + kv]), (a.v_proj, w["qkv"][q + kv:]),
                             (a.o_proj, w["o"]), (m.gate_proj, w["gate_up"][:cfg.intermediate_size]),
                             (m.up_proj, w["gate_up"][cfg.intermediate_size:]), (m.down_proj, w["down"])):
                dst.weight.copy_(src)
            a.q_norm.weight.copy_(w["q_norm"])
            a.k_norm.weight.copy_(w["k_norm"])
            layer.input_layernorm.weight.copy_(w["in_norm"])
            layer.post_attention_layernorm.weight.copy_(w["post_norm"])
        want = hf.generate(torch.tensor([[17]]), max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 1:].tolist()
    peer.pos.fill_(0)
    peer.token.fill_(17)
    got = []
    for _ in range(12):
        peer.step()
        got.append(int(peer.token))
    assert peer.pos.item() == 12
    assert got == want
