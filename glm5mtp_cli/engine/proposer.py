"""The DraftProposer protocol and the per-sequence ProposerState (ARCHITECTURE.md).

Row bookkeeping, shared by every proposer: drafter row i pairs target token t[i+1] with the
target's hidden h[i] and predicts t[i+2]. Rows built from target hiddens are "real"; rows built
during a draft chain (draft token + drafter hidden) are speculative and are dropped by
after_verify. After each catch-up the drafter holds exactly as many real rows as the target cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from glm5mtp_cli.engine.cache import SequenceCache


@dataclass
class DraftChain:
    """The drafts of one propose call for one sequence."""

    tokens: torch.Tensor  # [gamma] draft ids (entries past num_drafts are padding)
    probs: torch.Tensor | None  # [gamma, V] the distributions drafts were drawn from (sampling only)
    num_drafts: int  # drafts actually proposed (fewer than gamma after a confidence stop)
    confidence: float | None = None  # min top-1 probability over the chain, when computed


class DraftBatch:
    """The drafts of one fused propose call (every sequence `num_drafts` of them, greedy) as the
    one [A, num_drafts] device tensor the draft chain wrote, standing for the list of its rows'
    DraftChains: one is made only when read. Reading the batch row by row (a view per sequence,
    then checking the views back into one tensor) was host time in every step at batch 32 and 64.
    A state's last_chain is then the batch: what after_verify and last_confidence read of it."""

    __slots__ = ("tokens", "num_drafts")
    probs = None
    confidence = None

    def __init__(self, tokens: torch.Tensor, num_drafts: int):
        self.tokens, self.num_drafts = tokens, num_drafts

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i: int) -> DraftChain:
        return DraftChain(self.tokens[i], None, self.num_drafts, None)

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def draft_counts(chains, active: int) -> list[int]:
    """Drafts proposed per sequence by one propose call (chains: a list of DraftChain, a
    DraftBatch, or None for a step without drafts over `active` sequences)."""
    if not chains:
        return [0] * active
    if isinstance(chains, DraftBatch):
        return [chains.num_drafts] * active
    return [c.num_drafts for c in chains]


@dataclass
class DrafterKV:
    """A finished turn's drafter cache, taken out of its state to seed the next turn."""

    cache: SequenceCache
    rows: int
    tokens: list[int]  # the target tokens t[1..rows] the rows were built from (for checking)


@dataclass
class ProposerState:
    cache: SequenceCache | None
    budget_tokens: int
    real_rows: int = 0  # rows built from target hiddens; rows past this are speculative
    last_chain: DraftChain | DraftBatch | None = None
    row_tokens: list = field(default_factory=list)  # chunks of t[i+1], one per real row i (MtpHead._mark_real)
    gen: torch.Generator | None = None  # the request's random stream (sampled drafts); None: the proposer's


@runtime_checkable
class DraftProposer(Protocol):
    """A model family's drafter: what the engine (speculate.py) and the runner (graphs.py,
    prefill_graphs.py) call, nothing more. The engine owns the loop and the runner owns how
    forwards run; a proposer owns its per-sequence state and its drafting math, written once as
    functions of device tensors (drafter_forward, greedy_chain) that the runner calls eagerly, over
    static buffers, or inside a captured CUDA graph."""

    # per-sequence state
    def alloc_state(self) -> ProposerState: ...
    def alloc_state_for(self, budget_tokens: int) -> ProposerState: ...
    def free_state(self, state: ProposerState) -> None: ...  # safe twice
    def drafter_rows(self, state: ProposerState) -> int: ...
    # real rows: a finished turn's pending rows, and admissions' and backlogs' in shared forwards
    # (static: engine/prefill_graphs' forwards, or None)
    def catchup_drafter(self, tokens: torch.Tensor, hiddens: torch.Tensor, row_base: int,
                        state: ProposerState) -> None: ...
    def catchup_batch(self, tokens: list, hiddens: list, states: list[ProposerState], chunk: int,
                      budget: int, static=None) -> None: ...
    # drafting: tokens/hiddens are one tensor per sequence, as a list or as graphs.BatchRows; `runner`
    # is the engine's ForwardRunner; the result a list of DraftChain, or a DraftBatch (fused chain)
    def propose_batch(self, tokens, hiddens, positions: list[int], num_drafts: int,
                      states: list[ProposerState], runner) -> list[DraftChain] | DraftBatch: ...
    def greedy_fusable(self) -> bool: ...
    def after_verify(self, num_accepted: int, state: ProposerState) -> None: ...
    # the math the runner runs: contexts over cached rows, one forward, the fused greedy chain
    def context(self, starts: torch.Tensor, t: int, rows: dict): ...
    def drafter_forward(self, ids: torch.Tensor, hidden: torch.Tensor, ctx, rows) -> tuple[torch.Tensor, torch.Tensor]: ...
    def greedy_chain(self, ids, hidden, starts, last_real, context_at, gamma: int) -> torch.Tensor: ...
    # carry across turns
    def take_drafter_kv(self, state: ProposerState) -> DrafterKV: ...
    def install_drafter_kv(self, kv: DrafterKV, state: ProposerState) -> None: ...
    def free_drafter_kv(self, kv: DrafterKV) -> None: ...


class CatchupMisaligned(ValueError):
    """A catch-up feed that does not start at the drafter's current row count."""
