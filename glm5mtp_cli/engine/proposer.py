"""The DraftProposer protocol, the per-sequence ProposerState and what drafting passes around:
a batch's Feed in, its Drafts out (ARCHITECTURE.md).

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
from glm5mtp_cli.core.host_copy import to_device


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


class Feed:
    """The drafter rows one propose appends, for the whole batch: row j's first counts[j] entries
    of tokens [A, W] and hiddens [A, W, H] (device). An unchanged batch passes the last verify's
    rows as the one tensor they already are (the engine's drafter feed); a changed one gathers
    them (`gather`); a prefill pads each sequence's rows into one (`of`). One form for every feed: per-sequence views (two per sequence
    per step) were a fifth of the step loop's host time at gamma 3, batch 64 (diagnostics/host_time:
    1282-1339 -> 988-1054 us per step on this project's CPU)."""

    __slots__ = ("tokens", "hiddens", "counts")

    def __init__(self, tokens: torch.Tensor, hiddens: torch.Tensor, counts: list[int]):
        self.tokens, self.hiddens, self.counts = tokens, hiddens, counts

    @classmethod
    def of(cls, rows: list[tuple[torch.Tensor, torch.Tensor]], width: int | None = None) -> "Feed":
        """Each sequence's (tokens [n], hiddens [n, H]), zero-padded into one feed `width` rows wide
        (default: the longest)."""
        counts = [t.shape[0] for t, _ in rows]
        t0, h0 = rows[0]
        tokens = t0.new_zeros(len(rows), width or max(counts))
        hiddens = h0.new_zeros(len(rows), tokens.shape[1], h0.shape[-1])
        for j, (t, h) in enumerate(rows):
            tokens[j, : t.shape[0]] = t
            hiddens[j, : h.shape[0]] = h
        return cls(tokens, hiddens, counts)

    @classmethod
    def gather(cls, rows) -> "Feed":
        """A changed batch's pending rows (engine BatchRows: row i of one step's (tokens, hiddens),
        its first n) in one feed: the rows of each step's tensors in one gather (a batch of 64 after
        a finish is one, plus one per sequence admitted since), not two copies per sequence, which
        at batch 64 were a quarter of a gamma-3 step on an H100. Past a row's count the feed holds
        what followed it in its step's tensors (padding, as an unchanged batch's feed has)."""
        counts = [r.n for r in rows]
        width = max(counts)
        t0, h0 = rows[0].src
        tokens = t0.new_zeros(len(rows), width)
        hiddens = h0.new_zeros(len(rows), width, h0.shape[-1])
        groups: dict[int, tuple] = {}  # id of a step's tensors -> (them, feed rows, their rows)
        for j, r in enumerate(rows):
            _, dst, src = groups.setdefault(id(r.src), (r.src, [], []))
            dst.append(j)
            src.append(r.i)
        for (t, h), dst, src in groups.values():
            w = min(width, t.shape[1])
            if len(dst) == 1:
                tokens[dst[0], :w] = t[src[0], :w]
                hiddens[dst[0], :w] = h[src[0], :w]
                continue
            dst_t, src_t = to_device([dst, src], t.device)  # one copy for both
            tokens[:, :w].index_copy_(0, dst_t, t[:, :w].index_select(0, src_t))
            hiddens[:, :w].index_copy_(0, dst_t, h[:, :w].index_select(0, src_t))
        return cls(tokens, hiddens, counts)

    def __len__(self) -> int:
        return len(self.counts)


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
    # the ids t[i+1] of the real rows i, as (tokens [R, W], row j, n): row j's first n, on the device
    # (reading them back would sync every step; a carry's take_drafter_kv reads them)
    row_tokens: list = field(default_factory=list)
    gen: torch.Generator | None = None  # the request's random stream (sampled drafts); None: the proposer's

    def add_real(self, tokens: torch.Tensor, j: int, n: int) -> None:
        """n real rows went into the drafter, their ids row j's first n of tokens [R, W]."""
        self.real_rows += n
        self.row_tokens.append((tokens, j, n))

    def host_tokens(self) -> list[int]:
        return torch.cat([t[j, :n] for t, j, n in self.row_tokens]).tolist() if self.row_tokens else []


def check_aligned(row_base: int, state: ProposerState) -> None:
    """Refuse a feed that does not start at the drafter's current row count."""
    if state.cache is None:
        raise CatchupMisaligned("drafter state was freed or its KV taken")
    if row_base != state.cache.length or state.real_rows != state.cache.length:
        raise CatchupMisaligned(
            f"catch-up starts at row {row_base}, but the drafter holds {state.cache.length} rows "
            f"({state.real_rows} real): call after_verify first and feed from drafter_rows()")


@runtime_checkable
class DraftProposer(Protocol):
    """A model family's drafter: what the engine (speculate.py, drafting.py) and the runner
    (graphs.py, prefill_graphs.py) call, nothing more. The engine owns the loop, drafting included,
    and the runner owns how forwards run; a proposer owns its per-sequence state and describes its
    forwards as functions of device tensors (drafter_forward, greedy_chain) that the runner calls
    eagerly, over static buffers, or inside a captured CUDA graph; it never calls the runner."""

    # --draft-vocab's head (its `ids`: the full-vocabulary id of each drafter logit) or None; a
    # grammar mask over the full vocabulary reaches the drafter's logits through it
    draft_head: object | None

    # per-sequence state
    def alloc_state_for(self, budget_tokens: int) -> ProposerState: ...
    def free_state(self, state: ProposerState) -> None: ...  # safe twice
    def drafter_rows(self, state: ProposerState) -> int: ...
    # real rows: a finished turn's pending rows; the eager shared forwards of admissions and backlogs
    # (engine/prefill.prefill_drafters: ids [m, t], row j's first real[j] real, the rest cut back)
    def catchup_drafter(self, tokens: torch.Tensor, hiddens: torch.Tensor, row_base: int,
                        state: ProposerState) -> None: ...
    def append_rows(self, ids: torch.Tensor, hiddens: torch.Tensor, caches: list, real: list[int]) -> None: ...
    # drafting (engine/drafting.py): a propose starts, each draft's ids (full vocabulary) and the
    # distributions they were drawn from (None: greedy) from a forward's logits, chained steps
    def start_propose(self) -> None: ...
    def choose(self, logits: torch.Tensor, states: list[ProposerState]) -> tuple[torch.Tensor, torch.Tensor | None]: ...
    def chained(self): ...
    def after_verify(self, num_accepted: int, state: ProposerState) -> None: ...
    # the forwards the runner runs: contexts over cached rows, one forward, the fused greedy chain
    def context(self, starts: torch.Tensor, t: int, rows: dict): ...
    def drafter_forward(self, ids: torch.Tensor, hidden: torch.Tensor, ctx, rows) -> tuple[torch.Tensor, torch.Tensor]: ...
    def greedy_chain(self, ids, hidden, starts, last_real, context_at, gamma: int) -> torch.Tensor: ...
    # carry across turns
    def take_drafter_kv(self, state: ProposerState) -> DrafterKV: ...
    def install_drafter_kv(self, kv: DrafterKV, state: ProposerState) -> None: ...
    def free_drafter_kv(self, kv: DrafterKV) -> None: ...


@runtime_checkable
class TreeDrafter(Protocol):
    """A proposer that also drafts a tree plan's rows (engine/verify.py): drafts [A, plan.drafts] in the
    plan's row order, each row's token a guess at the target's token after its parent, from each
    sequence's pending feed (its real rows are appended, as a chain's propose appends them)."""

    def propose_tree(self, feed: "Feed", states: list[ProposerState], plan) -> "Drafts": ...


class CatchupMisaligned(ValueError):
    """A catch-up feed that does not start at the drafter's current row count."""
