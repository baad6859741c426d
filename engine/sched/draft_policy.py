"""Adaptive draft length (`--num-speculative-tokens auto`): the engine picks each round's k.

A round with k drafts emits, per request, 1 + sum_{j=1..k} prod_{i<=j} a_i tokens in expectation,
a_i being the probability that draft i is accepted once drafts 1..i-1 were. It costs C(k, B) for
a batch of B requests. The policy picks the k in [0, k_max] that maximises E(k) / C(k, B) from:

- a running estimate of a_i per engine: for every request-round, position i counts as *tried* when
  it was drafted and every draft before it was accepted, and as *accepted* when it was kept; both
  counts decay by `decay` per observation (recent text weighs more), starting from a weak prior.
  Positions beyond the chosen k are not observed, so every `explore_every`-th round drafts one
  more than it would (the next position's estimate stays current; if it rose, k grows and the
  position after it is probed in turn);
- a cost model of a round, relative to k = 0, seeded from the H200 bench (qwen3-8b bf16, TP1,
  bench/results/2026-11-30-h200): at batch 1 and context 512, ms per round 5.408 (k=0), 5.988,
  6.305, 6.951 and 7.943 (k = 1, 2, 3, 5); batch 8 at k=0 cost 0.49 ms more than batch 1
  (concurrency section: 170.7 against 186.4 tok/s per stream). A round's target forward takes
  max(weights, tokens x FLOPs) plus a per-token part; drafting adds what the batch-1 sweep shows.
  The model is not refined from the engine's own timings: its rounds mix prefill chunks, and the
  policy rarely runs the k it does not choose, so a measured table would be one-sided.

Choosing a smaller k is lossless: verification is the same rejection sampling whatever the count.
Pure Python (the scheduler calls it).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RoundCost:
    """C(k, B) in milliseconds of the seed shape; only ratios between k at one B matter."""

    weights_ms: float = 5.338          # the memory-bound forward: batch 1, k = 0, less one token's part
    token_ms: float = 0.070            # each token row of the verify forward (KV, sampling, host)
    flop_ms_per_token: float = 0.0235  # compute-bound rate: ~16.4 GFLOP per token at ~700 TFLOP/s
    # drafting k tokens at batch 1 (the sweep's extra ms over k=0, less the verify rows' token part)
    draft_ms: tuple[tuple[int, float], ...] = ((0, 0.0), (1, 0.510), (2, 0.757), (3, 1.333), (5, 2.185))

    def drafting(self, k: int) -> float:
        pts = self.draft_ms
        for (k0, m0), (k1, m1) in zip(pts, pts[1:]):
            if k <= k1:
                return m0 + (m1 - m0) * (k - k0) / (k1 - k0)
        (k0, m0), (k1, m1) = pts[-2], pts[-1]
        return m1 + (m1 - m0) / (k1 - k0) * (k - k1)

    def __call__(self, k: int, batch: int) -> float:
        tokens = batch * (k + 1)
        return max(self.weights_ms, tokens * self.flop_ms_per_token) + tokens * self.token_ms + self.drafting(k)


def expected_tokens(acceptance: list[float], k: int) -> float:
    """1 + sum_{j<=k} prod_{i<=j} a_i: tokens one request gains from a round with k drafts."""
    total, run = 1.0, 1.0
    for a in acceptance[:k]:
        run *= a
        total += run
    return total


def best_k(acceptance: list[float], batch: int, k_max: int, cost: RoundCost) -> int:
    """argmax_k E(k) / C(k, batch); ties go to the smaller k."""
    best, best_rate = 0, -1.0
    for k in range(k_max + 1):
        rate = expected_tokens(acceptance, k) / cost(k, batch)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = k, rate
    return best


@dataclass
class DraftPolicy:
    k_max: int
    cost: RoundCost = field(default_factory=RoundCost)
    decay: float = 0.99                # per observation of a position (~100 request-rounds remembered)
    prior: float = 0.6                 # a_i before anything was seen ...
    prior_weight: float = 2.0          # ... worth this many observations
    explore_every: int = 32            # every n-th round drafts one more than the best k
    rounds: int = 0

    def __post_init__(self) -> None:
        self.tried = [self.prior_weight] * self.k_max
        self.accepted = [self.prior * self.prior_weight] * self.k_max

    @property
    def acceptance(self) -> list[float]:
        return [a / t for a, t in zip(self.accepted, self.tried)]

    def choose(self, batch: int) -> int:
        """This round's k for a batch of `batch` requests."""
        self.rounds += 1
        k = best_k(self.acceptance, batch, self.k_max, self.cost)
        if self.explore_every and self.rounds % self.explore_every == 0:
            return min(k + 1, self.k_max)
        return k

    def observe(self, drafted: int, accepted: int) -> None:
        """One request's round: `drafted` drafts proposed, the first `accepted` of them kept."""
        for i in range(min(accepted + 1, drafted)):
            self.tried[i] = self.tried[i] * self.decay + 1.0
            self.accepted[i] = self.accepted[i] * self.decay + (1.0 if i < accepted else 0.0)
