"""TTFT of a burst: N prompts of P tokens submitted together, against one such prompt alone.

The packed prefill lane (`engine.sched.prefill_lane`) lets prompts that wait together share a chunk, so
the burst's median time to first token should stay a small multiple of one prompt's (docs/performance.md:
`ttft_8x512_over_single` <= 3 at N = 8, P = 512). Every TTFT is the request's own (`timings.ttft`:
arrival to first token, on the engine's clock); the figure is the median over every request of
every burst over the median of the prompts sent alone. Prompts are fresh random ids (no prefix hits).
"""

from __future__ import annotations

import statistics

from engine.sampling_params import SamplingParams
from tools.bench.session import compact, random_prompt


def ttft_burst(session, streams: int, prompt: int, repeats: int, timeout: float) -> dict:
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    alone = [compact(session.generate(random_prompt(prompt, session.vocab), params, timeout=timeout))
             for _ in range(repeats)]
    bursts = []
    for _ in range(repeats):
        stats = session.generate_many([random_prompt(prompt, session.vocab) for _ in range(streams)],
                                      [params] * streams, timeout=timeout)
        bursts.append([compact(s) for s in stats])
    single = statistics.median(r["ttft_s"] for r in alone)
    pooled = [r["ttft_s"] for burst in bursts for r in burst]
    median = statistics.median(pooled)
    return {"streams": streams, "prompt": prompt, "repeats": repeats,
            "prefill_chunk": alone[0]["prefill_chunk"],
            "single_ttft_s_median": single, "burst_ttft_s_median": median,
            "burst_ttft_s_max": max(pooled), "over_single": median / single if single > 0 else None,
            "alone": alone, "bursts": bursts}
