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


class Drafts:
    """The drafts of one propose call for the whole batch, as the device tensors the chain wrote:
    tokens [A, g] (row i's first counts[i] are proposed; fewer than g after a confidence stop),
    probs [A, g, V] (sampling: the distributions they were drawn from) or None, confidence (the
    chain's min top-1 probability per row, --draft-conf-tau) or None. One object for every way of
    drafting, read row by row (a DraftChain) only where a row is needed: a view per sequence per
    step was host time at batch 32 and 64 (diagnostics/host_time)."""

    __slots__ = ("tokens", "counts", "probs", "confidence")

    def __init__(self, tokens: torch.Tensor, counts: list[int], probs: torch.Tensor | None = None,
                 confidence: list[float] | None = None):
        self.tokens, self.counts, self.probs, self.confidence = tokens, counts, probs, confidence

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i: int) -> DraftChain:
        return DraftChain(self.tokens[i], None if self.probs is None else self.probs[i], self.counts[i],
                          None if self.confidence is None else self.confidence[i])

    def __iter__(self):
        return (self[i] for i in range(len(self)))


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
    last_drafts: Drafts | None = None  # the last propose call's, this state's row `row` of them
    row: int = 0
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
    # is the engine's ForwardRunner; grammar: engine/grammar.StepMasks (masked drafting) or None
    def propose_batch(self, tokens, hiddens, positions: list[int], num_drafts: int,
                      states: list[ProposerState], runner, grammar=None) -> Drafts: ...
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
