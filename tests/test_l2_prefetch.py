"""The decode round's weight prefetch into L2 (engine/kernels/l2_prefetch.py): which layer prefetches
which (the chain along `decode_linears`, the shared tiny models and the 27B hybrid preset, built on the
meta device), how the byte cap is shared, and on a CUDA device that a captured graph with the forked
prefetches computes what the eager layers compute."""

from __future__ import annotations

import pytest
import torch

from conftest import require_shared_model
from engine.layers.linear import _Linear
from engine.loader import read_model_dir


def _prefetch_module():
    from engine.kernels import l2_prefetch
    return l2_prefetch


def _linked(cfg, with_mtp):
    from engine.models.registry import model_class
    l2 = _prefetch_module()
    with torch.device("meta"):
        model = model_class(cfg)(cfg, with_mtp=with_mtp)
    l2.link(model.decode_linears())
    return model


def _next_of(module):
    return [id(p) for p in module.prefetch_next]


def _params(module):
    return [id(p) for p in module.parameters(recurse=False)]


def test_prefix_bytes_shares_the_cap_by_size():
    l2 = _prefetch_module()
    assert l2.prefix_bytes([1000, 33], 4096) == [992, 32]               # all of it, 16-byte multiples
    parts = l2.prefix_bytes([48 << 20, 6 << 20, 4096], 24 << 20)        # weight, scales, row scale
    assert sum(parts) <= 24 << 20 and all(p % 16 == 0 for p in parts)
    assert parts[0] / (48 << 20) == pytest.approx(parts[1] / (6 << 20), rel=1e-6)
    assert l2.prefix_bytes([1 << 20], 0) == [0]


@pytest.mark.parametrize("with_mtp", [True, False])
def test_qwen3_chain_follows_the_round(with_mtp):
    model = _linked(read_model_dir(require_shared_model()).config, with_mtp)
    layers = model.model.layers
    for i, layer in enumerate(layers):
        a, m = layer.self_attn, layer.mlp
        assert _next_of(a.qkv_proj) == _params(a.o_proj)
        assert _next_of(a.o_proj) == _params(m.gate_up_proj)
        assert _next_of(m.gate_up_proj) == _params(m.down_proj)
        after = layers[i + 1].self_attn.qkv_proj if i + 1 < len(layers) else model.lm_head
        assert _next_of(m.down_proj) == _params(after)
    if with_mtp:
        assert _next_of(model.lm_head) == _params(model.mtp.fc)
        assert _next_of(model.mtp.fc) == _params(model.mtp.layers[0].self_attn.qkv_proj)
        assert _next_of(model.mtp.layers[-1].mlp.down_proj) == _params(model.lm_head)
    else:
        # the next round starts at layer 0: the prefetch crosses the graph boundary
        assert _next_of(model.lm_head) == _params(layers[0].self_attn.qkv_proj)
    every = [m for m in model.modules() if isinstance(m, _Linear)] + [model.lm_head]
    assert all(m.prefetch_next for m in every)


def test_hybrid_chain_runs_in_proj_before_out_proj():
    from engine.presets import preset
    model = _linked(preset("qwen3.5-27b"), with_mtp=True)
    linear = next(layer for layer in model.model.layers if layer.is_linear)
    full = next(layer for layer in model.model.layers if not layer.is_linear)
    d = linear.linear_attn
    after_in = d.in_proj_ba if d.in_proj_ba is not None else d.out_proj
    assert _next_of(d.in_proj) == _params(after_in)
    assert _next_of(d.out_proj) == _params(linear.mlp.gate_up_proj)
    assert _next_of(full.self_attn.qkv_proj) == _params(full.self_attn.o_proj)
    assert _next_of(model.mtp.layers[-1].mlp.down_proj) == _params(model.lm_head)


def test_nothing_is_forked_outside_a_capture():
    l2 = _prefetch_module()
    a, b = _Linear(64, 64, _single()), _Linear(64, 32, _single())
    for layer in (a, b):
        layer.weight.data.normal_()
    l2.link([a, b])
    x = torch.randn(2, 64)
    assert torch.equal(b(a(x)), torch.nn.functional.linear(torch.nn.functional.linear(x, a.weight), b.weight))
    assert not l2._forked


def _single():
    from engine.parallel import SINGLE_RANK
    return SINGLE_RANK


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_prefetch_chain_computes_the_eager_result():
    from engine.cuda_graphs import capture_graph
    l2 = _prefetch_module()
    dev = torch.device("cuda")
    with torch.device(dev):
        layers = [_Linear(4096, 12288, _single()), _Linear(12288, 4096, _single()), _Linear(4096, 4096, _single())]
    for layer in layers:
        layer.weight.data = (torch.randn_like(layer.weight, dtype=torch.float32) * 0.02).to(torch.bfloat16)
    l2.link(layers)
    x = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)

    def forward():
        y = x
        for layer in layers:
            y = layer(y)
        forked = l2._forked.get(torch.cuda.current_device(), False)
        return y, forked

    eager, forked_eagerly = forward()
    graph = torch.cuda.CUDAGraph()
    (captured, forked_in_capture) = capture_graph(graph, forward)
    assert not forked_eagerly and forked_in_capture == (l2.max_bytes() > 0)
    assert not l2._forked                                       # joined before the capture ended
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    x.copy_(torch.randn_like(x))
    graph.replay()
    ref, _ = forward()
    torch.cuda.synchronize()
    assert torch.equal(captured, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prefetch_of_odd_sizes_runs_eagerly():
    l2 = _prefetch_module()
    tensors = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (16, 1_000_016, 40 << 20)]
    l2.prefetch(tensors, 24 << 20)
    l2.join()
    torch.cuda.synchronize()
    assert not l2._forked
