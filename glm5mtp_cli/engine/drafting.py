"""Drafting a batch: the engine's loop over a DraftProposer's forwards, run by the ForwardRunner.

A propose first appends each sequence's pending real rows (the Feed: tokens accepted since the last
propose, each paired with the target hidden of the position before it) in one catch-up forward;
the last of those rows yields draft 1. Each further draft feeds the previous one with the drafter's
carried hidden, one chained row per sequence per forward, every sequence at once, so each weight is
read once per draft position for the whole batch. Greedy with no confidence stop, a runner with
static forwards runs the whole chain as one forward (the fused chain), unless a grammar masks the
drafts: each position's logits are then masked by the state after the drafts before it
(engine/grammar.StepMasks), so the chain runs position by position. The proposer describes the
forwards and turns their logits into draft ids (`choose`); the runner runs them; this loop knows
neither how. A fused chain can also start a step early (`launch_ahead`): launched from the verify's
device verdict before that step's host read, it runs while the host reads and keeps its books, and
the next step settles it on the host (`settle_ahead`) instead of proposing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glm5mtp_cli.core.host_copy import to_device
from glm5mtp_cli.engine.proposer import DraftProposer, Drafts, Feed, ProposerState, TreeDrafter, check_aligned


def fusable(sampling, tau: float | None) -> bool:
    """Whether a batch's whole draft chain can be one forward: greedy, no confidence stop."""
    return sampling.greedy and tau is None


def propose(head: DraftProposer, runner, feed: Feed, states: list[ProposerState], g: int,
            tau: float | None, masks=None) -> Drafts:
    """g drafts for each of the batch's sequences (fewer where the chain's top-1 probability fell
    below `tau`, --draft-conf-tau); feed row j is states[j]'s pending real rows; masks: the step's
    grammar masks (masked drafting) or None."""
    for st in states:
        check_aligned(st.real_rows, st)
    caches = [st.cache for st in states]
    head.start_propose()
    fused = runner.fused_chain(feed, caches, g) if g and masks is None else None
    drafts = (Drafts(fused, [g] * len(states)) if fused is not None
              else _chain(head, runner, feed, caches, states, g, tau, masks))
    return _record(drafts, feed, states)


def propose_tree(head: TreeDrafter, feed: Feed, states: list[ProposerState], plan) -> Drafts:
    """A tree plan's drafts for the batch's sequences, drafted by the proposer itself (eager: no
    forward of a tree's drafting is described to the runner, as yet)."""
    for st in states:
        check_aligned(st.real_rows, st)
    head.start_propose()
    return _record(head.propose_tree(feed, states, plan), feed, states)


def _record(drafts: Drafts, feed: Feed, states: list[ProposerState]) -> Drafts:
    """Each drafter state holds its feed's rows as real and the drafts it proposed."""
    for j, st in enumerate(states):
        st.add_real(feed.tokens, j, feed.counts[j])
        st.last_drafts, st.row = drafts, j
    return drafts


def _chain(head: DraftProposer, runner, feed: Feed, caches: list, states: list[ProposerState], g: int,
           tau: float | None, masks) -> Drafts:
    """The catch-up forward, then one chained forward per further draft."""
    logits, carried = runner.catchup(head, feed, caches)
    b = len(states)
    drafts, probs, confs = [], [], []
    active = [True] * b
    counts = [0] * b
    for i_step in range(g):
        if masks is not None:
            logits = masks.draft(i_step, logits, head.draft_head)
        d, q = head.choose(logits, states)
        if masks is not None:
            masks.drafted(d[:, None])
        drafts.append(d)
        probs.append(q)
        if tau is not None:
            top1 = (q if q is not None else logits.float().softmax(-1)).max(-1).values
            confs.append(top1)
            low = (top1 < tau).tolist()  # host sync: only with --draft-conf-tau
            for i in range(b):
                if active[i] and i_step > 0 and low[i]:
                    active[i] = False
        for i in range(b):
            counts[i] += active[i]
        if i_step == g - 1 or not any(active):
            break
        with head.chained():
            logits, carried = runner.chain_step(head, d, carried, caches)
    tokens = torch.stack(drafts, 1) if drafts else torch.empty(b, 0, dtype=torch.long, device=logits.device)
    probs = torch.stack(probs, 1) if drafts and probs[0] is not None else None
    confs = [float(min(c[i] for c in confs[: max(counts[i], 1)])) for i in range(b)] if confs else None
    return Drafts(tokens, counts, probs, confs)


@dataclass
class Ahead:
    """The next step's greedy draft chain, launched at the end of this one before its host read
    (`launch_ahead`): the sequences it drafts for, in order, its gamma, its drafts [A, g], and the
    clock mark before it (where the next step's propose starts)."""

    seqs: list
    g: int
    drafts: Drafts
    start: object

    def take(self, seqs: list, g: int) -> Drafts | None:
        """The drafts of `seqs` at gamma g, where the chain drafted for every one of them (a batch
        some sequences left since: their rows), else None (the chain is dropped)."""
        at = {id(s): i for i, s in enumerate(self.seqs)}
        rows = [at.get(id(s)) for s in seqs]
        if g != self.g or None in rows:
            return None
        if rows == list(range(len(self.seqs))):
            return self.drafts
        return Drafts(self.drafts.tokens[to_device(rows, self.drafts.tokens.device)], [g] * len(seqs))


def launch_ahead(head: DraftProposer, runner, seqs: list, fed: tuple, accepted: torch.Tensor, g: int,
                 start) -> Ahead | None:
    """The fused chain of the next propose for `seqs` (engine sequences), from this verify's device
    verdict: feed row j is fed's (tokens, hiddens) row j, its first accepted[j] + 1 real (the
    drafter's next feed, accept.drafter_feed); start: the clock mark before it. Nothing on the host
    moves until `settle_ahead`, so a chain the next step does not take is dropped as it is: its
    rows lie past each drafter's real ones. None where the runner has no fused chain for it."""
    states = [s.state for s in seqs]
    head.start_propose()
    fused = runner.fused_chain_ahead(fed[0], fed[1], accepted, [st.cache for st in states],
                                     [st.real_rows for st in states], g)
    return None if fused is None else Ahead(list(seqs), g, Drafts(fused, [g] * len(states)), start)


def settle_ahead(drafts: Drafts, feed: Feed, states: list[ProposerState]) -> Drafts:
    """The host's part of a propose launched ahead, now that its feed's counts are known: what
    `propose` and the runner's load do around a fused chain (each drafter cache grows by its feed
    and g - 1 chained rows)."""
    g = drafts.tokens.shape[1]
    for j, st in enumerate(states):
        check_aligned(st.real_rows, st)
        st.cache.length += feed.counts[j] + g - 1
    return _record(drafts, feed, states)
