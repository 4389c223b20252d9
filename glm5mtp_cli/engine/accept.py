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
    """What one verify decided per sequence. On the device: the next tokens and the accepted counts
    (the target's commit and the drafter's next feed are queued from them before any host read).
    On the host once `read`: drafts proposed and accepted, the target's next token and the drafted
    ids (empty or None without drafts)."""

    proposed: list[int]
    next_dev: torch.Tensor
    accepted_dev: torch.Tensor
    rows: torch.Tensor | None = None  # greedy_verdict's rows [A, 2 + g] while still unread
    accepted: list[int] | None = None
    next: list[int] | None = None
    draft_ids: list[list[int]] | None = None
    _host: torch.Tensor | None = None  # the rows' host copy while it lands (fetch)
    _landed: object = None  # its CUDA event

    def fetch(self) -> None:
        """Queue the rows' copy to the host and mark it, so that `read` waits for this copy alone,
        not for work queued after it (the next step's drafts launched ahead)."""
        if self.rows is not None and self.rows.is_cuda and self._host is None:
            self._host = self.rows.to("cpu", non_blocking=True)  # pinned, asynchronous
            self._landed = torch.cuda.Event()
            self._landed.record()

    def read(self) -> None:
        """The rows to the host in one read (the step's one sync); a no-op once read."""
        if self.rows is not None:
            self.fetch()
            if self._landed is not None:
                self._landed.synchronize()
            host = (self._host if self._host is not None else self.rows).tolist()
            self.rows, self._host, self._landed = None, None, None
            self.accepted, self.next, self.draft_ids = [r[0] for r in host], [r[1] for r in host], [r[2:] for r in host]

    def clip(self, caps: list[int], eos: set[int]) -> None:
        """Once read: each sequence's accepted drafts cut at its first drafted EOS and at caps[i] (the
        most drafts its token budget still takes, one token being the target's own); where cut, the
        next token is the draft it was cut at (an EOS, or the token the target chose there). So
        nothing past a reply's end is emitted, counted or committed. clip_rows is the same rule on
        the device, for what is committed before the read."""
        for i, a in enumerate(self.accepted):
            drafted = self.draft_ids[i]
            cut = next((j for j in range(min(a, caps[i])) if drafted[j] in eos), min(a, caps[i]))
            if cut < a:
                self.accepted[i], self.next[i] = cut, drafted[cut]

    def clip_device(self, caps: torch.Tensor, eos: torch.Tensor) -> None:
        """`clip` on the unread rows (caps [A], the EOS ids [E] on the device), before the commit
        queued from them: a carried fixed-size state must stop at the reply's end."""
        if self.rows is not None:
            self.rows = clip_rows(self.rows, caps, eos)
            self.next_dev, self.accepted_dev = self.rows[:, 1], self.rows[:, 0]


def clip_rows(rows: torch.Tensor, caps: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    """Verdict rows [A, 2 + g] cut as Verdict.clip cuts them (its host lists are the reference)."""
    acc, drafts = rows[:, 0], rows[:, 2:]
    g = drafts.shape[1]
    if g == 0:
        return rows  # the target's own token alone: always kept
    pos = torch.arange(g, device=rows.device)
    stop = torch.isin(drafts, eos) | (pos[None, :] >= caps[:, None])
    cut = torch.minimum(acc, torch.where(stop, pos[None, :], g).amin(1))
    at_cut = drafts.gather(1, cut.clamp(max=g - 1)[:, None])[:, 0]
    return torch.cat([cut[:, None], torch.where(cut < acc, at_cut, rows[:, 1])[:, None], drafts], dim=1)


def greedy_verdict(logits: torch.Tensor, drafts: torch.Tensor, proposed: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy match on the device: [A, 2 + g] rows of (drafts accepted, the target's next token, the
    g drafts) from the verified logits [A, g + 1, V] and the drafts [A, g] (g may be 0). proposed
    [A]: where a confidence stop proposed fewer, the drafts past them are not matched. Also traced
    into a greedy engine's verify graphs (graphs.py), so that their accept is one read."""
    target_tokens = logits.argmax(-1)  # [A, g + 1]
    match = target_tokens[:, :-1] == drafts
    if proposed is not None:
        match &= torch.arange(drafts.shape[1], device=drafts.device)[None, :] < proposed[:, None]
    acc = match.cumprod(1).sum(1)
    return torch.cat([acc[:, None], target_tokens.gather(1, acc[:, None]), drafts], dim=1)


def accept(drafts: Drafts | None, logits: torch.Tensor, gens: list, sampling,
           verdict: torch.Tensor | None = None) -> Verdict:
    """Greedy match or rejection sampling (each sequence from its own stream, gens) over the
    verified logits [A, g + 1, V]; greedy decides on the device and is read later, once
    (Verdict.read). verdict: greedy_verdict of these logits and drafts, already computed (a verify
    graph's), taken where every sequence proposed all its drafts."""
    proposed = drafts.counts if drafts is not None else [0] * logits.shape[0]
    if sampling.greedy:
        tokens = drafts.tokens if drafts is not None else logits.new_empty((logits.shape[0], 0), dtype=torch.long)
        if min(proposed, default=0) < tokens.shape[1]:  # a confidence stop proposed fewer drafts somewhere
            verdict = greedy_verdict(logits, tokens, torch.tensor(proposed, device=logits.device))
        elif verdict is None:
            verdict = greedy_verdict(logits, tokens)
        return unread(proposed, verdict)
    acc, nxt = [], []
    no_drafts = logits.new_empty(0, dtype=torch.long)
    for i, gen in enumerate(gens):
        d, q = (no_drafts, None) if drafts is None else (drafts.tokens[i], drafts.probs[i])
        a, t = accept_rejection(d, q, logits[i], proposed[i], sampling, gen)
        acc.append(a)
        nxt.append(t)
    both = torch.tensor([acc, nxt], dtype=torch.long, device=logits.device).T  # one copy for both
    # rows as greedy's, read once (the drafts' one copy to the host)
    return unread(proposed, both if drafts is None else torch.cat([both, drafts.tokens], dim=1))


def accept_synthetic(drafts: Drafts, logits: torch.Tensor, gens: list, sampling,
                     draws: SyntheticAcceptance) -> Verdict:
    """--synthetic-acceptance: the first a drafts kept as drawn (engine/synthetic.py), then the
    target's own token at position a; one host read, as greedy's."""
    tokens, proposed = drafts.tokens, drafts.counts
    n = torch.tensor(proposed, device=logits.device) if min(proposed) < tokens.shape[1] else None
    acc = draws.accepted(tokens.shape[0], tokens.shape[1], n)
    at = logits.gather(1, acc[:, None, None].expand(-1, 1, logits.shape[-1]))[:, 0]  # [A, V]
    nxt, _ = choose(at, sampling, gens)
    return unread(proposed, torch.cat([acc[:, None], nxt[:, None], tokens], dim=1))


def unread(proposed: list[int], rows: torch.Tensor) -> Verdict:
    """A Verdict of rows [A, 2 + g] (greedy_verdict's) still on the device; its device tensors are
    views of them."""
    return Verdict(proposed, rows[:, 1], rows[:, 0], rows)


def drafter_feed(drafts: torch.Tensor, acc: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
    """[A, g + 1] device rows whose first a_i + 1 are sequence i's next drafter tokens: its a_i
    accepted drafts, then the target's token (built once for the batch: no host copy of tokens,
    and an unchanged batch's next draft reads it whole, proposer.Feed)."""
    pos = torch.arange(drafts.shape[1] + 1, device=drafts.device)
    return torch.where(pos[None, :] < acc[:, None], torch.cat([drafts, drafts[:, :1]], dim=1), nxt[:, None])
