"""Calls on an MtpHead that only tests make (the engine drafts whole batches through the runner):
one sequence's propose, a prompt's drafter prefill, the confidence of a state's last drafts, and
whether the layer is sharded over ranks (its proposes must then run in lockstep on every rank)."""

from __future__ import annotations

import torch

from glm5mtp_cli.engine import drafting
from glm5mtp_cli.engine.hooks import watch
from glm5mtp_cli.engine.graphs import ForwardRunner
from glm5mtp_cli.engine.proposer import Feed, check_aligned
from observe import Around


def prefill_drafter(head, prompt_tokens: torch.Tensor, hiddens: torch.Tensor, state) -> None:
    """Drafter rows 0..P-2 of a prompt: (t[i+1], h[i])."""
    if prompt_tokens.shape[0] >= 2:
        head.catchup_drafter(prompt_tokens[1:], hiddens[:-1], 0, state)


def propose_one(head, last_token, hidden: torch.Tensor, position: int, num_drafts: int, state):
    """One sequence's DraftChain, through an eager runner."""
    tokens = torch.as_tensor(last_token, device=hidden.device).reshape(-1)
    check_aligned(position, state)
    feed = Feed(tokens[None], hidden.reshape(1, tokens.shape[0], -1), [tokens.shape[0]])
    return drafting.propose(head, ForwardRunner("eager", hidden.device), feed, [state], num_drafts, None)[0]


def spy_proposes(engine, seen: list) -> None:
    """Every propose the engine makes appends (its feed, its states, the Drafts it returned) to `seen`."""
    def spy(engine, propose, feed, states, *args):
        drafts = propose(feed, states, *args)
        seen.append((feed, states, drafts))
        return drafts

    watch(engine, Around({"propose": spy}))


def last_confidence(state) -> float | None:
    drafts = state.last_drafts
    return drafts.confidence[state.row] if drafts is not None and drafts.confidence is not None else None


def sharded(head) -> bool:
    comm = getattr(head.layer, "comm", None)
    return comm is not None and comm.world > 1
