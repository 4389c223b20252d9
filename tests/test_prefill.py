"""engine/prefill.py's plan: every prompt row prefilled once, in order, within the budget and the
chunk, no padding past a sequence's reservation, one sequence per forward where caches cannot
take padding."""

from __future__ import annotations

import pytest

from glm5mtp_cli.engine.prefill import plan_forwards


def _check(plan, remaining, headroom, chunk, budget):
    got = [0] * len(remaining)
    room = list(headroom)
    for t, members in plan:
        assert 1 <= t <= chunk and members
        assert len(members) == 1 or len(members) * t <= budget
        for i, k in members:
            assert 1 <= k <= t and room[i] >= t  # padding rows stay inside the reservation
            assert k == t or got[i] + k == remaining[i]  # only a prompt's last chunk is short
            got[i] += k
            room[i] -= k
    assert got == remaining


@pytest.mark.parametrize("remaining,headroom,chunk,budget", [
    ([44, 2, 17, 3, 31], [60, 14, 25, 16, 44], 8, 24),
    ([44, 2, 17, 3, 31], [60, 14, 25, 16, 44], 1024, 8192),
    ([5] * 10, [9] * 10, 1024, 12),
])
def test_plan_covers_every_row_within_limits(remaining, headroom, chunk, budget):
    plan = plan_forwards(remaining, headroom, chunk, budget)
    _check(plan, remaining, headroom, chunk, budget)
    assert len(plan) < sum(-(-r // chunk) for r in remaining)  # shared: fewer forwards than prompts' chunks


def test_short_prompt_waits_when_the_padding_would_pass_its_reservation():
    plan = plan_forwards([500, 20], [628, 21], 1024, 8192)  # 20 cannot take 480 padding rows
    _check(plan, [500, 20], [628, 21], 1024, 8192)
    assert plan == [(500, [(0, 500)]), (20, [(1, 20)])]


def test_similar_lengths_grouped_longest_first():
    plan = plan_forwards([30, 4, 29, 5], [40, 40, 40, 40], 1024, 64)
    assert plan == [(30, [(0, 30), (2, 29)]), (5, [(3, 5), (1, 4)])]


def test_refuses_a_prompt_over_its_reservation():
    with pytest.raises(RuntimeError):
        plan_forwards([10], [9], 8, 64)
