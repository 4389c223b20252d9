"""Rejection sampling keeps the target's distribution (statistical test on a small vocabulary).

Speculative sampling's promise: whatever the draft distribution q, the emitted tokens follow the
target's p. Here the target's rows are fixed (a target whose next-token distribution does not
depend on the previous token), drafts are drawn from a deliberately different q, and the empirical
distribution of the first two emitted tokens is compared with p[0] x p[1] in total variation.
The same bound is shown to fail for two broken samplers, so the test has teeth.
"""

from __future__ import annotations

import torch

from glm5mtp_cli.engine.sampling import SamplingParams, accept_rejection, draw, probs_from_logits

V = 6
N = 12000
BOUND = 0.03  # TV of an exact sampler over 36 cells at N samples is ~0.015


def _setup():
    g = torch.Generator().manual_seed(0)
    target_logits = torch.randn(3, V, generator=g) * 1.5  # rows for positions 0, 1, 2
    q = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)  # the drafter's distributions
    params = SamplingParams(temperature=1.0, seed=0)
    p = probs_from_logits(target_logits, params)
    return target_logits, q, params, p


def _emitted(sampler, n=N):
    target_logits, q, params, _ = _setup()
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(V, V)
    for _ in range(n):
        drafts = draw(q, [gen, gen])  # d1 ~ q[0], d2 ~ q[1]
        first, second = sampler(drafts, q, target_logits, params, gen)
        counts[first, second] += 1
    return counts / n


def _exact(drafts, q, target_logits, params, gen):
    accepted, token = accept_rejection(drafts, q, target_logits, 2, params, gen)
    out = drafts[:accepted].tolist() + [token]
    if len(out) < 2:  # rejected at the first draft: the next token is a fresh draw from the target
        out.append(int(draw(probs_from_logits(target_logits[1:2], params), [gen])[0]))
    return out[0], out[1]


def _tv(a, b):
    return 0.5 * (a - b).abs().sum().item()


def test_emitted_tokens_follow_the_target_distribution():
    _, _, _, p = _setup()
    want = p[0][:, None] * p[1][None, :]
    assert _tv(_emitted(_exact), want) < BOUND


def test_the_bound_rejects_broken_samplers():
    _, q, _, p = _setup()
    want = p[0][:, None] * p[1][None, :]

    def always_accept(drafts, q, target_logits, params, gen):
        return int(drafts[0]), int(drafts[1])

    def resample_from_p(drafts, q, target_logits, params, gen):
        """Accept with min(1, p/q) but on rejection draw from p instead of normalise(max(p - q, 0))."""
        pp = probs_from_logits(target_logits, params)
        out = []
        for i in range(2):
            d = int(drafts[i])
            if torch.rand((), generator=gen) * q[i, d] <= pp[i, d]:
                out.append(d)
            else:
                out.append(int(draw(pp[i:i + 1], [gen])[0]))
                break
        if len(out) < 2:
            out.append(int(draw(pp[1:2], [gen])[0]))
        return out[0], out[1]

    assert _tv(_emitted(always_accept, 4000), want) > BOUND
    assert _tv(_emitted(resample_from_p, 4000), want) > BOUND


# A grammar's mask (engine/grammar.py) bans tokens per position: here tokens 0 and 3 at position 0,
# 1, 4 and 5 at position 1, each row masked in place before temperature (kernels/bitmask.py).
BANNED = [[0, 3], [1, 4, 5], [2]]


def _masked(logits: torch.Tensor) -> torch.Tensor:
    from kernels.bitmask import apply_bitmask_ref

    bits = torch.full((logits.shape[0], 1), (1 << V) - 1, dtype=torch.int32)
    for row, banned in enumerate(BANNED[: logits.shape[0]]):
        for t in banned:
            bits[row] &= ~(1 << t)
    return apply_bitmask_ref(logits.clone(), bits)


def _under_mask(mask_drafts: bool):
    """Rejection sampling between the masked target and the draft distribution, masked and
    renormalised (masked drafting) or left whole (--no-draft-mask: drafts the grammar bans occur)."""
    def sampler(drafts, q, target_logits, params, gen):
        if mask_drafts:
            q = probs_from_logits(_masked(q.log()), params)
            drafts = draw(q, [gen, gen])
        return _exact(drafts, q, _masked(target_logits), params, gen)
    return sampler


def test_under_a_grammar_the_emitted_tokens_follow_the_masked_target():
    _, _, params, _ = _setup()
    target_logits = _setup()[0]
    p = probs_from_logits(_masked(target_logits), params)  # the constrained target: renormalised over what is allowed
    want = p[0][:, None] * p[1][None, :]
    for mask_drafts in (True, False):
        got = _emitted(_under_mask(mask_drafts))
        assert _tv(got, want) < BOUND, mask_drafts
        assert got[BANNED[0]].sum() == 0 and got[:, BANNED[1]].sum() == 0  # a banned token is never emitted


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
