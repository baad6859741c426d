"""The speculative verifier preserves the target distribution (rejection sampling, Leviathan et al.).

`engine.worker.sampler.verify` runs on many rows at once, each with its own seed so that the counter-based
RNG gives independent draws; drafts are sampled from q by `engine.worker.sampler.draft`, exactly as the
decode round does. With k = 2 the first emitted token must follow p_1 and, in rounds that accepted
d_1, the second must follow p_2 whatever the first was. The same chi-square bound rejects two broken
verifiers built from the same draws (always accept; on rejection resample from p instead of the
residual), so the test cannot pass by accident.
"""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.worker import sampler

V = 6
N = 40_000
P_LOGITS = [[1.5, 0.2, 0.0, -0.5, -1.0, 0.8], [0.0, 1.0, -1.0, 0.5, 0.3, -2.0], [0.3, 0.3, 0.3, 0.3, 0.3, 0.3]]
Q_LOGITS = [[0.0, 1.2, 0.4, 0.4, -2.0, 0.0], [1.0, -0.5, 0.0, 1.5, -1.0, 0.2]]   # draft far from target


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    support = probs > 0
    if bool((counts[~support] > 0).any()):
        return 0.0
    n = counts.sum()
    expected = probs[support] * n
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def hist(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=V).double()


def run_verify(params: SamplingParams, n: int = N, k: int = 2, seed0: int = 1 << 20, num_drafts: int | None = None):
    s = sampler.SamplingBatch.build([params] * n, [seed0 + i for i in range(n)], [0] * n, "cpu")
    target = torch.tensor(P_LOGITS[:k + 1]).unsqueeze(0).repeat(n, 1, 1)               # [N, k+1, V]
    drafts, qs = [], []
    for j in range(k):
        d, q = sampler.draft(torch.tensor([Q_LOGITS[j]]).repeat(n, 1), s.shifted(j), V)
        drafts.append(d)
        qs.append(q)
    drafts_t, q_t = torch.stack(drafts, 1), torch.stack(qs, 1)
    nd = torch.full((n,), k if num_drafts is None else num_drafts)
    out, num_accepted = sampler.verify(target, drafts_t, q_t, nd, s)
    p = sampler.probabilities(target.reshape(-1, V), s.repeat(k + 1)).view(n, k + 1, V)[0].double()
    return out, num_accepted, drafts_t, q_t[0].double(), p, s, target


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9),
                                    SamplingParams(temperature=1.2, top_k=4)],
                         ids=["T=1", "T=0.7,top_p=0.9", "T=1.2,top_k=4"])
def test_verify_preserves_the_target_distribution(params):
    out, num_accepted, drafts, q, p, s, target = run_verify(params)
    first = out[:, 0]
    assert bool((first >= 0).all())
    pv1 = chi2_pvalue(hist(first), p[0])
    tv1 = 0.5 * float((hist(first) / N - p[0]).abs().sum())
    # the acceptance rate of d_1 is sum_v min(p_1, q_1) (binomial, 5 sigma)
    alpha = float(torch.minimum(p[0], q[0]).sum())
    rate = float((num_accepted >= 1).double().mean())
    assert abs(rate - alpha) <= 5 * (alpha * (1 - alpha) / N) ** 0.5, (rate, alpha)
    # second token, in rounds that kept d_1: distributed as p_2 overall and given each first token
    kept = num_accepted >= 1
    second = out[kept, 1]
    pv2 = chi2_pvalue(hist(second), p[1])
    conditional = {}
    for a in range(V):
        rows = kept & (first == a)
        if int(rows.sum()) >= 2000:
            conditional[a] = chi2_pvalue(hist(out[rows, 1]), p[1])
    print(f"\nverify {params.temperature=} {params.top_k=} {params.top_p=}: first token p={pv1:.3f} "
          f"(TV {tv1:.4f}); acceptance {rate:.4f} vs sum min(p,q) {alpha:.4f}; second token p={pv2:.3f} over "
          f"{int(kept.sum())} rounds; given x1: " + ", ".join(f"{a}: {v:.3f}" for a, v in conditional.items()))
    assert pv1 > 1e-3 and tv1 < 0.01
    assert pv2 > 1e-3
    assert len(conditional) >= 2 and min(conditional.values()) > 1e-4
    # accepted drafts are emitted as drafted; the bonus follows the accepted ones; the rest is -1
    for j in range(2):
        rows = num_accepted > j
        assert torch.equal(out[rows, j], drafts[rows, j])
    assert bool((out[num_accepted < 2, 2] == -1).all())

    # -- the same bound rejects broken verifiers fed the same draws ------------------------------
    always_accept = drafts[:, 0]                                  # first token ~ q_1
    assert chi2_pvalue(hist(always_accept), p[0]) < 1e-6
    resample_from_p = torch.where(kept, drafts[:, 0], sampler.sample(target[:, 0], s))
    assert chi2_pvalue(hist(resample_from_p), p[0]) < 1e-6


def test_rows_without_drafts_sample_the_target():
    """A request whose own k is 0 in a speculative batch: nothing is accepted, the token follows p_1."""
    out, num_accepted, _, _, p, _, _ = run_verify(SamplingParams(temperature=1.0), num_drafts=0, seed0=7 << 30)
    assert int(num_accepted.max()) == 0 and bool((out[:, 1:] == -1).all())
    assert chi2_pvalue(hist(out[:, 0]), p[0]) > 1e-3


def test_identical_draft_and_target_accept_everything():
    n, k = 2000, 2
    s = sampler.SamplingBatch.build([SamplingParams(temperature=1.0)] * n, list(range(n)), [0] * n, "cpu")
    logits = torch.tensor(P_LOGITS[:k]).unsqueeze(0).repeat(n, 1, 1)
    drafts, qs = zip(*(sampler.draft(logits[:, j], s.shifted(j), V) for j in range(k)))
    target = torch.cat([logits, torch.tensor(P_LOGITS[2]).view(1, 1, V).repeat(n, 1, 1)], 1)
    out, num_accepted = sampler.verify(target, torch.stack(drafts, 1), torch.stack(qs, 1), torch.full((n,), k), s)
    assert bool((num_accepted == k).all())


def test_greedy_verification_is_argmax_matching():
    vocab, k = 5, 3
    target = torch.full((3, k + 1, vocab), -1.0)
    argmax = [[1, 2, 3, 4], [0, 0, 0, 0], [4, 3, 2, 1]]
    for b, row in enumerate(argmax):
        for i, t in enumerate(row):
            target[b, i, t] = 5.0
    drafts = torch.tensor([[1, 2, 3], [0, 1, 0], [2, 3, 2]])
    s = sampler.SamplingBatch.build([SamplingParams(temperature=0.0)] * 3, [0, 1, 2], [0, 0, 0], "cpu")
    out, num_accepted = sampler.verify(target, drafts, None, torch.tensor([3, 3, 3]), s)
    assert num_accepted.tolist() == [3, 1, 0]
    assert out.tolist() == [[1, 2, 3, 4], [0, 0, -1, -1], [4, -1, -1, -1]]
    # a request's own k limits acceptance even where later drafts match
    out, num_accepted = sampler.verify(target, drafts, None, torch.tensor([1, 3, 0]), s)
    assert num_accepted.tolist() == [1, 1, 0] and out.tolist()[0] == [1, 2, -1, -1]
