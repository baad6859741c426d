"""EngineCore's side of a prefill/decode hand-off (engine.cache.kv_landing): whole landings count among the
parked and attached (max_parked), so the hidden-state pool keeps a row for every request the prefill lane
admits; a request admitted over a landing starts from the producer's token and, at its end, the engine
holds nothing (blocks, references, hidden-state rows). The transfer itself is tests/services/smg/test_pd.py."""

from __future__ import annotations

from engine import EngineConfig, SamplingParams
from engine.cache import kv_landing
from engine.core import EngineCore
from tests.conftest import FakeClock, assert_kv_idle, run_to_idle


def test_whole_landings_are_bounded_by_max_parked_and_leave_nothing_held():
    core = EngineCore(EngineConfig(kv_capacity=1024, prefill_chunk=64, draft_tokens=2, max_batch=2),
                      clock=FakeClock(0.0))
    prompt = list(range(1, 40))
    blocks = kv_landing.prompt_blocks(len(prompt), core.kv.block_size)
    first, second = (core.reserve_landing(rid, prompt, blocks, whole=True) for rid in ("a", "b"))
    assert first is not None and second is not None and first.hidden_row >= 0
    assert core.reserve_landing("c", prompt, blocks, whole=True) is None          # max_parked = max_batch = 2
    core.drop_landing(second)
    assert core.snapshot()["kv"]["mtp_hidden_rows_used"] == 1
    req, outputs = core.add_pulled(first, prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                                   first_token_id=5, request_id="a")
    assert [o.new_token_ids for o in outputs] == [[5]] and req.num_cached_tokens == len(prompt)
    third = core.reserve_landing("c", prompt, blocks, whole=True)                 # "a" is attached: one left
    assert third is not None and core.reserve_landing("d", prompt, blocks, whole=True) is None
    core.drop_landing(third)
    run_to_idle(core)
    assert len(req.output_token_ids) == 4 and req.computed_prefill_tokens == 0
    assert_kv_idle(core)
    assert core.snapshot()["kv"]["mtp_hidden_rows_used"] == 0
