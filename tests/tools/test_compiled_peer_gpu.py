"""The compiled decode peer on a CUDA device, in both of its modes: Inductor compiles the whole step
(tiny preset, float32 so the argmax does not hinge on rounding), every timed step is one CUDA graph,
and the graph's tokens are the eager step's. Before the bench trusts `decode_b1_over_compiled_peer`,
this says the peer it times is the step it claims: compiled, tuned, graphed and correct."""

from __future__ import annotations

import pytest
import torch

from engine.loading.presets import preset
from tools.bench.compiled_peer import MODES, CompiledDecodePeer

STEPS = 10


def _tokens(peer: CompiledDecodePeer, first: int, replay: bool) -> list[int]:
    peer.pos.fill_(0)
    peer.token.fill_(first)
    got = []
    for _ in range(STEPS):
        if replay and peer.graph is not None:
            peer.graph.replay()
        else:
            peer.step()
        got.append(int(peer.token))
    return got


@pytest.mark.parametrize("mode", MODES)
def test_the_compiled_step_is_graphed_and_equals_the_eager_step(mode):
    cfg = preset("tiny")
    eager = CompiledDecodePeer(cfg, "cuda", torch.float32, max_len=64, mode=None)
    want = _tokens(eager, 5, replay=False)
    peer = CompiledDecodePeer(cfg, "cuda", torch.float32, max_len=64, mode=mode, model=eager.model)
    peer.warm()
    d = peer.describe()
    assert d["compiled"] and d["fullgraph"] and d["inductor_settings"]["coordinate_descent_tuning"]
    assert d["cuda_graph"] is not None, d                         # no timed step runs launch by launch
    if mode == "max-autotune-no-cudagraphs" or d["inductor_cudagraph_skips"]:
        assert peer.graph is not None
    assert _tokens(peer, 5, replay=True) == want
    seconds = peer.run(0, STEPS)
    assert 0 < seconds and peer.pos.item() == STEPS
