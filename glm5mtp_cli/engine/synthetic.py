"""Synthetic acceptance (--synthetic-acceptance P1,P2,...): verify decisions drawn from given rates
instead of from the models, to time speculation at a chosen acceptance on random weights.

P_k is the conditional probability that draft k is accepted given drafts 1..k-1 were; positions past
the list take its last value. The cumulative per-position rates that `acceptance` reports (vLLM's:
steps whose first k drafts were all accepted) are their running products: `cumulative` and
`conditional` are the one conversion. A synthetic step keeps the first a drafts, whatever the target
says of them, then emits the target's own token at position a (greedy or sampled), so the output is
not the target's: nothing synthetic is lossless. The draws come from one generator on the device
(seeded from --seed), without a host sync; they depend on which sequences share a step.
"""

from __future__ import annotations

import torch

from glm5mtp_cli.engine.config import check_rates
from glm5mtp_cli.engine.gamma import expected_tokens
from glm5mtp_cli.errors import UserError


def parse_rates(text: str, flag: str = "--synthetic-acceptance") -> tuple[float, ...]:
    """'0.8,0.6,0.4' -> (0.8, 0.6, 0.4): conditional acceptance per draft position, each in [0, 1]."""
    try:
        rates = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise UserError(f"{flag} {text!r}: give comma-separated probabilities, e.g. 0.8,0.6,0.4") from None
    check_rates(rates, flag)
    return rates


def cumulative(conditional: tuple[float, ...] | list[float]) -> list[float]:
    """Per-position rates as `acceptance` reports them: P(first k drafts all accepted)."""
    out, run = [], 1.0
    for p in conditional:
        run *= p
        out.append(run)
    return out


def conditional(cumulative_rates: list[float]) -> list[float]:
    """The inverse of `cumulative`, a_k = p_k / p_{k-1} (0 past a position no step reached); bench's
    recommendation reads acceptance's rates through it too."""
    out, prev = [], 1.0
    for c in cumulative_rates:
        out.append(c / prev if prev > 0 else 0.0)
        prev = c
    return out


def expected_acceptance_length(rates: tuple[float, ...], gamma: int) -> float:
    """Mean acceptance length (the bonus token counted) of `gamma` drafts at these rates."""
    return expected_tokens(_per_position(rates, gamma), gamma)


def _per_position(rates: tuple[float, ...], gamma: int) -> list[float]:
    return [rates[min(k, len(rates) - 1)] for k in range(gamma)]


class SyntheticAcceptance:
    """Draws each step's accepted counts on the device."""

    def __init__(self, rates: tuple[float, ...], seed: int, device: torch.device):
        self.rates = rates
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self._p: dict[int, torch.Tensor] = {}  # gamma -> [gamma] rates on the device (few gammas)
        self.device = device

    def accepted(self, num_rows: int, gamma: int, proposed: torch.Tensor | None) -> torch.Tensor:
        """[num_rows] accepted drafts: the leading run of draws u_k < P_k, at most `proposed` (a
        confidence stop's counts, None: gamma each)."""
        if gamma not in self._p:
            self._p[gamma] = torch.tensor(_per_position(self.rates, gamma), device=self.device)
        keep = (torch.rand(num_rows, gamma, generator=self.gen, device=self.device) < self._p[gamma]).int()
        if proposed is not None:
            keep = keep * (torch.arange(gamma, device=self.device)[None, :] < proposed[:, None])
        return keep.cumprod(1).sum(1)
