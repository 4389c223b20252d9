"""The accept phase of a step: what one verify keeps of each sequence's drafts (greedy match,
rejection sampling, or --synthetic-acceptance's draws), read to the host once, as a Verdict; and
the drafter rows the next propose is fed from it. A verdict is a path through the verify's plan
(engine/verify.py): a chain's is its first `accepted` drafts; a tree's names its rows too."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glm5mtp_cli.engine.proposer import Drafts
from glm5mtp_cli.engine.sampling import accept_rejection, choose
from glm5mtp_cli.engine.synthetic import SyntheticAcceptance
from glm5mtp_cli.engine.verify import VerifyPlan


@dataclass
class Verdict:
    """What one verify decided per sequence. On the device: the next tokens and the accepted counts
    (the target's commit and the drafter's next feed are queued from them before any host read).
    On the host once `read`: drafts proposed and accepted, the target's next token and the drafted
    ids along the accepted path (a chain: all its drafts; empty without drafts), and a tree's path
    rows. The rows [A, 2 + g] are (accepted, next, the g drafts), a tree's [A, 2 + 2 D] (accepted,
    next, the D tokens and D rows of its path; past `accepted`: placeholders)."""

    proposed: list[int]
    next_dev: torch.Tensor
    accepted_dev: torch.Tensor
    rows: torch.Tensor | None = None  # while still unread
    plan: VerifyPlan | None = None  # None: a chain
    accepted: list[int] | None = None
    next: list[int] | None = None
    draft_ids: list[list[int]] | None = None
    path: list[list[int]] | None = None  # a tree's accepted rows, row 0 left out
    _host: torch.Tensor | None = None  # the rows' host copy while it lands (fetch)
    _landed: object = None  # its CUDA event

    def fetch(self) -> None:
        """Queue the rows' copy to the host and mark it, so that `read` waits for this copy alone,
        not for work queued after it (the next step's drafts launched ahead)."""
        if self.rows is not None and self.rows.is_cuda and self._host is None and self.accepted is None:
            self._host = self.rows.to("cpu", non_blocking=True)  # pinned, asynchronous
            self._landed = torch.cuda.Event()
            self._landed.record()

    def read(self) -> None:
        """The rows to the host in one read (the step's one sync); a no-op once read, or where the host
        decided them (rejection sampling)."""
        if self.rows is not None and self.accepted is not None:
            self.rows = None
        if self.rows is not None:
            self.fetch()
            if self._landed is not None:
                self._landed.synchronize()
            host = (self._host if self._host is not None else self.rows).tolist()
            self.rows, self._host, self._landed = None, None, None
            self.accepted, self.next = [r[0] for r in host], [r[1] for r in host]
            d = self.plan.depth if self.plan is not None else None
            self.draft_ids = [r[2:2 + d] if d is not None else r[2:] for r in host]
            if d is not None:
                self.path = [r[2 + d:] for r in host]

    @property
    def last_row_dev(self) -> torch.Tensor:
        """[A] on the device: each sequence's last accepted row of the verify (a chain's: its count)."""
        if self.plan is None:
            return self.accepted_dev
        path = self.rows[:, 2 + self.plan.depth:]
        at = (self.accepted_dev - 1).clamp(min=0)[:, None]
        return torch.where(self.accepted_dev > 0, path.gather(1, at)[:, 0], 0)

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


def greedy_verdict(logits: torch.Tensor, drafts: torch.Tensor, proposed: torch.Tensor | None = None,
                   plan: VerifyPlan | None = None) -> torch.Tensor:
    """Greedy match on the device: [A, 2 + g] rows of (drafts accepted, the target's next token, the
    g drafts) from the verified logits [A, g + 1, V] and the drafts [A, g] (g may be 0). proposed
    [A]: where a confidence stop proposed fewer, the drafts past them are not matched. Also traced
    into a greedy engine's verify graphs (graphs.py), so that their accept is one read. A tree plan:
    tree_verdict's rows."""
    if plan is not None and not plan.is_chain:
        return tree_verdict(logits, drafts, plan)
    target_tokens = logits.argmax(-1)  # [A, g + 1]
    match = target_tokens[:, :-1] == drafts
    if proposed is not None:
        match &= torch.arange(drafts.shape[1], device=drafts.device)[None, :] < proposed[:, None]
    acc = match.cumprod(1).sum(1)
    return torch.cat([acc[:, None], target_tokens.gather(1, acc[:, None]), drafts], dim=1)


def tree_verdict(logits: torch.Tensor, drafts: torch.Tensor, plan: VerifyPlan) -> torch.Tensor:
    """Greedy match over a tree plan's rows: a row is accepted where its parent is and its draft is the
    target's token there; the deepest accepted row (the first in the plan's order among the deepest)
    ends the path. -> [A, 2 + 2 D] rows (Verdict)."""
    target_tokens = logits.argmax(-1)  # [A, R]
    ok = [torch.ones_like(target_tokens[:, 0], dtype=torch.bool)]
    for i, p in enumerate(plan.parents[1:], 1):
        ok.append(ok[p] & (drafts[:, i - 1] == target_tokens[:, p]))
    depth = torch.tensor(plan.depths, device=logits.device)
    order = torch.arange(plan.rows, 0, -1, device=logits.device)  # earlier rows win ties
    best = torch.where(torch.stack(ok, 1), depth * (plan.rows + 1) + order, 0).argmax(1)  # [A]
    path = torch.tensor(plan.paths, device=logits.device)[best]  # [A, D]
    tokens = torch.cat([torch.zeros_like(drafts[:, :1]), drafts], dim=1).gather(1, path)  # row 0's: a placeholder
    return torch.cat([depth[best][:, None], target_tokens.gather(1, best[:, None]), tokens, path], dim=1)


def accept(drafts: Drafts | None, logits: torch.Tensor, gens: list, sampling,
           verdict: torch.Tensor | None = None, plan: VerifyPlan | None = None) -> Verdict:
    """Greedy match or rejection sampling (each sequence from its own stream, gens) over the
    verified logits [A, g + 1, V]; greedy decides on the device and is read later, once
    (Verdict.read). verdict: greedy_verdict of these logits and drafts, already computed (a verify
    graph's), taken where every sequence proposed all its drafts."""
    proposed = drafts.counts if drafts is not None else [0] * logits.shape[0]
    tree = plan if plan is not None and not plan.is_chain else None
    if sampling.greedy:
        tokens = drafts.tokens if drafts is not None else logits.new_empty((logits.shape[0], 0), dtype=torch.long)
        if min(proposed, default=0) < tokens.shape[1]:  # a confidence stop proposed fewer drafts somewhere
            verdict = greedy_verdict(logits, tokens, torch.tensor(proposed, device=logits.device))
        elif verdict is None:
            verdict = greedy_verdict(logits, tokens, plan=tree)
        return unread(proposed, verdict, tree)
    if tree is not None:
        raise NotImplementedError("a tree plan's drafts are accepted greedily only, as yet")
    acc, nxt = [], []
    no_drafts = logits.new_empty(0, dtype=torch.long)
    for i, gen in enumerate(gens):
        d, q = (no_drafts, None) if drafts is None else (drafts.tokens[i], drafts.probs[i])
        a, t = accept_rejection(d, q, logits[i], proposed[i], sampling, gen)
        acc.append(a)
        nxt.append(t)
    both = torch.tensor([acc, nxt], dtype=torch.long, device=logits.device).T  # one copy for both
    rows = both if drafts is None else torch.cat([both, drafts.tokens], dim=1)  # greedy's, for the device's part
    return Verdict(proposed, rows[:, 1], rows[:, 0], rows, accepted=acc, next=nxt,
                   draft_ids=[[] for _ in acc] if drafts is None else drafts.tokens.tolist())


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


def unread(proposed: list[int], rows: torch.Tensor, plan: VerifyPlan | None = None) -> Verdict:
    """A Verdict of rows (greedy_verdict's) still on the device; its device tensors are views of
    them. plan: a tree's (None: a chain)."""
    return Verdict(proposed, rows[:, 1], rows[:, 0], rows, plan)


def drafter_feed(v: Verdict, drafts: torch.Tensor, hidden_all: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's next feed from the verdict's device rows: tokens [A, D + 1] whose first a_i + 1 are
    sequence i's next drafter tokens (its a_i accepted drafts, then the target's token), and the
    verify's hiddens along the accepted path (a chain's: all of them, in place). Built once for the
    batch: no host copy of tokens, and an unchanged batch's next draft reads it whole (proposer.Feed)."""
    path = drafts if v.plan is None else v.rows[:, 2:2 + v.plan.depth]
    pos = torch.arange(path.shape[1] + 1, device=path.device)
    tokens = torch.where(pos[None, :] < v.accepted_dev[:, None], torch.cat([path, path[:, :1]], dim=1),
                         v.next_dev[:, None])
    if v.plan is None:
        return tokens, hidden_all
    rows = torch.cat([torch.zeros_like(path[:, :1]), v.rows[:, 2 + v.plan.depth:]], dim=1)
    return tokens, hidden_all.gather(1, rows[:, :, None].expand(-1, -1, hidden_all.shape[-1]))
