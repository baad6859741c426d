"""TTFT of a burst: N prompts of P tokens submitted together, against one such prompt alone.

The packed prefill lane (`engine.sched.prefill_lane`) lets prompts that wait together share a chunk, so
the burst's median time to first token should stay a small multiple of one prompt's (the target:
`ttft_8x512_over_single` <= 3 at N = 8, P = 512). Every TTFT is the request's own (`timings.ttft`:
arrival to first token, on the engine's clock). Rounds alternate a prompt alone and a burst (`order`);
a round's ratio is the median TTFT of its burst over its prompt alone, and the figure is the median of
the rounds' ratios (derive.py recomputes it from `alone` and `bursts`). Prompts are fresh random ids.
"""

from __future__ import annotations

import statistics

from engine.sampling_params import SamplingParams
from tools.bench.session import compact, random_prompt


def round_ratio(alone: dict, burst: list[dict]) -> float | None:
    single = alone["ttft_s"]
    return statistics.median(r["ttft_s"] for r in burst) / single if single > 0 else None


def ttft_burst(session, streams: int, prompt: int, repeats: int, timeout: float) -> dict:
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    alone, bursts, order = [], [], []
    for _ in range(repeats):
        alone.append(compact(session.generate(random_prompt(prompt, session.vocab), params, timeout=timeout)))
        order.append("alone")
        stats = session.generate_many([random_prompt(prompt, session.vocab) for _ in range(streams)],
                                      [params] * streams, timeout=timeout)
        bursts.append([compact(s) for s in stats])
        order.append("burst")
    pooled = [r["ttft_s"] for burst in bursts for r in burst]
    ratios = [x for x in (round_ratio(a, b) for a, b in zip(alone, bursts)) if x is not None]
    return {"streams": streams, "prompt": prompt, "repeats": repeats, "sides": ["alone", "burst"], "order": order,
            "prefill_chunk": alone[0]["prefill_chunk"],
            "single_ttft_s_median": statistics.median(r["ttft_s"] for r in alone),
            "burst_ttft_s_median": statistics.median(pooled), "burst_ttft_s_max": max(pooled),
            "over_single": statistics.median(ratios) if ratios else None, "per_round_ratio": ratios,
            "alone": alone, "bursts": bursts}
