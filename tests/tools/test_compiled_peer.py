"""The bench's compiled decode peer (tools/bench/compiled_peer.py) computes the real Qwen3 step: with
the same weights, its greedy tokens equal Hugging Face transformers' (the reference allowed in tests).
On the CPU the step runs eagerly, and compiled whole by Dynamo with `fullgraph=True` (a compiler-free
backend): a graph break anywhere in the step fails here, before a GPU ever compiles it with Inductor."""

from __future__ import annotations

import pytest
import torch

from engine.loading.presets import preset
from tools.bench import compiled_peer
from tools.bench.compiled_peer import CompiledDecodePeer

STEPS = 12


def _hf_tokens(cfg, model, first: int) -> list[int]:
    from transformers import Qwen3Config, Qwen3ForCausalLM
    hf = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=64, tie_word_embeddings=False,
        attention_bias=False, attn_implementation="eager")).eval()
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(model.embed)
        hf.model.norm.weight.copy_(model.final_norm)
        hf.lm_head.weight.copy_(model.lm_head)
        for layer, w in zip(hf.model.layers, model.layers):
            a, m = layer.self_attn, layer.mlp
            for dst, src in ((a.q_proj, w.qkv[:q]), (a.k_proj, w.qkv[q:q + kv]), (a.v_proj, w.qkv[q + kv:]),
                             (a.o_proj, w.o), (m.gate_proj, w.gate_up[:cfg.intermediate_size]),
                             (m.up_proj, w.gate_up[cfg.intermediate_size:]), (m.down_proj, w.down)):
                dst.weight.copy_(src)
            a.q_norm.weight.copy_(w.q_norm)
            a.k_norm.weight.copy_(w.k_norm)
            layer.input_layernorm.weight.copy_(w.in_norm)
            layer.post_attention_layernorm.weight.copy_(w.post_norm)
        return hf.generate(torch.tensor([[first]]), max_new_tokens=STEPS, do_sample=False, pad_token_id=0)[0, 1:].tolist()


def _peer_tokens(peer: CompiledDecodePeer, first: int) -> list[int]:
    peer.pos.fill_(0)
    peer.token.fill_(first)
    got = []
    for _ in range(STEPS):
        peer.step()
        got.append(int(peer.token))
    assert peer.pos.item() == STEPS
    return got


@pytest.fixture(scope="module")
def peer_and_reference():
    cfg = preset("tiny")
    peer = CompiledDecodePeer(cfg, "cpu", torch.float32, max_len=48, mode=None)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():                                 # norms other than ones: their code is checked too
        for w in peer.model.layers:
            for norm in (w.in_norm, w.post_norm, w.q_norm, w.k_norm):
                norm.copy_(1 + 0.2 * torch.randn(norm.shape, generator=gen))
        peer.model.final_norm.copy_(1 + 0.2 * torch.randn(peer.model.final_norm.shape, generator=gen))
    return cfg, peer, _hf_tokens(cfg, peer.model, 17)


def test_the_peer_step_generates_what_transformers_generates(peer_and_reference):
    _, peer, want = peer_and_reference
    assert _peer_tokens(peer, 17) == want


def test_the_whole_step_compiles_as_one_graph_and_gives_the_same_tokens(peer_and_reference):
    """fullgraph=True over the whole step (every layer, lm_head, argmax, the state written back): Dynamo
    raises on any graph break. The compiled step shares the eager peer's weights and buffers."""
    cfg, peer, want = peer_and_reference
    compiled = CompiledDecodePeer(cfg, "cpu", torch.float32, max_len=48, mode="reduce-overhead", backend="eager",
                                  model=peer.model)
    assert _peer_tokens(compiled, 17) == want
    assert _peer_tokens(compiled, 17) == want           # the second pass replays what was traced
    d = compiled.describe()
    assert d["fullgraph"] and d["static_kv_cache"] and not d["compiled"]      # no Inductor on the CPU


def test_gpt_fast_settings_are_the_ones_applied():
    """The Inductor settings gpt-fast sets hold while the peer compiles: coordinate-descent tuning first
    (without it Inductor leaves the one-row matmuls to cuBLAS)."""
    import torch._inductor.config as inductor_config
    assert compiled_peer.INDUCTOR_SETTINGS["coordinate_descent_tuning"] is True
    assert compiled_peer.DEFAULT_MODE == "max-autotune-no-cudagraphs" and "reduce-overhead" in compiled_peer.MODES
    before = inductor_config.coordinate_descent_tuning
    peer = CompiledDecodePeer(preset("tiny"), "cpu", torch.float32, max_len=8, mode=None)
    with peer._settings():
        assert inductor_config.coordinate_descent_tuning is True
        assert inductor_config.triton.unique_kernel_names is True and inductor_config.fx_graph_cache is True
    assert inductor_config.coordinate_descent_tuning == before          # scoped: the engine's compiles keep theirs
    with pytest.raises(ValueError, match="mode"):
        CompiledDecodePeer(preset("tiny"), "cpu", torch.float32, max_len=8, mode="default")
