"""The accept phase of a step: what one verify keeps of each sequence's drafts (greedy match,
rejection sampling, or --synthetic-acceptance's draws), read to the host once, as a Verdict; and
the drafter rows the next propose is fed from it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glm5mtp_cli.engine.proposer import Drafts
from glm5mtp_cli.engine.sampling import accept_rejection, choose
from glm5mtp_cli.engine.synthetic import SyntheticAcceptance


@dataclass
class Verdict:
    """What one verify decided per sequence: on the host, drafts proposed and accepted, the
    target's next token and the drafted ids (None without drafts); on the device, the next tokens
    and the accepted counts (the drafter's next feed is built from them without a host copy)."""

    proposed: list[int]
    accepted: list[int]
    next: list[int]
    draft_ids: list[list[int]] | None
    next_dev: torch.Tensor
    accepted_dev: torch.Tensor


def accept(drafts: Drafts | None, logits: torch.Tensor, gens: list, sampling) -> Verdict:
    """Greedy match or rejection sampling (each sequence from its own stream, gens) over the
    verified logits [A, g + 1, V]; greedy reads the device once."""
    proposed = drafts.counts if drafts is not None else [0] * logits.shape[0]
    if sampling.greedy:
        target_tokens = logits.argmax(-1)  # [A, g + 1]
        if drafts is None:
            nxt = target_tokens[:, 0]
            return Verdict(proposed, proposed, nxt.tolist(), None, nxt, torch.zeros_like(nxt))
        tokens = drafts.tokens
        match = (target_tokens[:, :-1] == tokens).int()
        if min(proposed) < tokens.shape[1]:  # a confidence stop proposed fewer drafts somewhere
            n = torch.tensor(proposed, device=logits.device)
            match = match * (torch.arange(tokens.shape[1], device=logits.device)[None, :] < n[:, None])
        acc = match.cumprod(1).sum(1)
        return _read(proposed, acc, target_tokens.gather(1, acc[:, None])[:, 0], tokens)
    acc, nxt = [], []
    no_drafts = logits.new_empty(0, dtype=torch.long)
    for i, gen in enumerate(gens):
        d, q = (no_drafts, None) if drafts is None else (drafts.tokens[i], drafts.probs[i])
        a, t = accept_rejection(d, q, logits[i], proposed[i], sampling, gen)
        acc.append(a)
        nxt.append(t)
    both = torch.tensor([acc, nxt], dtype=torch.long, device=logits.device)  # one copy for both
    return Verdict(proposed, acc, nxt, None if drafts is None else drafts.tokens.tolist(), both[1], both[0])


def accept_synthetic(drafts: Drafts, logits: torch.Tensor, gens: list, sampling,
                     draws: SyntheticAcceptance) -> Verdict:
    """--synthetic-acceptance: the first a drafts kept as drawn (engine/synthetic.py), then the
    target's own token at position a; one host read, as greedy's."""
    tokens, proposed = drafts.tokens, drafts.counts
    n = torch.tensor(proposed, device=logits.device) if min(proposed) < tokens.shape[1] else None
    acc = draws.accepted(tokens.shape[0], tokens.shape[1], n)
    at = logits.gather(1, acc[:, None, None].expand(-1, 1, logits.shape[-1]))[:, 0]  # [A, V]
    nxt, _ = choose(at, sampling, gens)
    return _read(proposed, acc, nxt, tokens)


def _read(proposed: list[int], acc: torch.Tensor, nxt: torch.Tensor, tokens: torch.Tensor) -> Verdict:
    """The accepted counts, next tokens and drafts to the host in one read (the step's one sync)."""
    host = torch.cat([acc[:, None], nxt[:, None], tokens], dim=1).tolist()
    return Verdict(proposed, [r[0] for r in host], [r[1] for r in host], [r[2:] for r in host], nxt, acc)


def drafter_feed(drafts: torch.Tensor, acc: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
    """[A, g + 1] device rows whose first a_i + 1 are sequence i's next drafter tokens: its a_i
    accepted drafts, then the target's token (built once for the batch: no host copy of tokens,
    and an unchanged batch's next draft reads it whole, proposer.Feed)."""
    pos = torch.arange(drafts.shape[1] + 1, device=drafts.device)
    return torch.where(pos[None, :] < acc[:, None], torch.cat([drafts, drafts[:, :1]], dim=1), nxt[:, None])
