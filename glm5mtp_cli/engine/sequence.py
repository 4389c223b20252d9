"""A request, its result, and the engine's record of it while it runs; what a request reserves."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from glm5mtp_cli.constraint import Constraint
from glm5mtp_cli.engine.cache import SequenceCache
from glm5mtp_cli.engine.carry import Carry
from glm5mtp_cli.engine.metrics import Acceptance
from glm5mtp_cli.engine.proposer import Feed, ProposerState


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    request_id: int = 0
    carry: Carry | None = None  # the previous turn's caches of this conversation (consumed)
    carry_mode: str = "none"  # what to hand back for the next turn: none | drafter | all
    constraint: Constraint | None = None  # its output's grammar (None: the config's, if any)


@dataclass
class SeqResult:
    request_id: int
    prompt_tokens: int
    tokens: list[int]
    finish_reason: str
    acceptance: Acceptance
    ttft_s: float
    prefill_s: float
    decode_s: float
    propose_s: list[float] = field(default_factory=list)  # per draft, per step
    verify_s: list[float] = field(default_factory=list)
    records: list["StepRecord"] = field(default_factory=list)  # one per verify step, its times read
    state_bytes: dict[str, int] = field(default_factory=dict)
    queue_s: float = 0.0  # from the generate call to this request's admission
    prefilled_target_rows: int = 0
    prefilled_drafter_rows: int = 0
    carried_target_rows: int = 0
    carried_drafter_rows: int = 0
    carry_out: Carry | None = None
    constraint: str | None = None  # Constraint.describe() of a constrained request
    complete: bool | None = None  # constrained: the grammar was completed (finish grammar or eos)
    valid: bool | None = None  # constrained and complete: the output matches, by a fresh matcher

    @property
    def trace(self) -> list[dict]:
        """One row per verify step (generate --trace), built when read: not on the step loop's host
        path, where a finishing sequence would build one dict per step it ran."""
        rows = []
        for r in self.records:
            prop, ver = r.times.times
            row = {"step": len(rows), "request": self.request_id, "position": r.position, "drafts": r.drafts,
                   "accepted": r.accepted, "emitted": len(r.emitted), "draft_ids": r.draft_ids,
                   "emitted_ids": r.emitted, "propose_ms": prop * 1e3, "verify_ms": ver * 1e3}
            if r.grammar_valid is not None:
                row["grammar_rejected"] = r.drafts - r.grammar_valid
            rows.append(row)
        return rows


class StepRecord(NamedTuple):
    """One verify step of one sequence, as the trace and the latency figures read it at its end (a
    tuple: one is made per sequence and step, on the step's host path)."""

    times: object  # clock.StepTimes, shared by the step's sequences
    drafts: int
    accepted: int
    position: int
    emitted: list[int]
    draft_ids: list[int]
    grammar_valid: int | None = None  # constrained: drafts the grammar allowed (the rest it rejected)


class BatchRow(NamedTuple):
    """Row i of one step's batch tensors `src` (each [A, >=n, ...]), its first n entries: how a
    sequence holds the device values a step left it, so that a batch seated as that step's was
    passes the step's tensors on whole (`whole_batch`), with no view or copy per sequence. A tuple:
    one is made per sequence and step."""

    src: tuple
    i: int
    n: int

    @classmethod
    def own(cls, *tensors: torch.Tensor) -> "BatchRow":
        """Tensors of its own ([n, ...] each), as the only row of a batch."""
        return cls(tuple(t[None] for t in tensors), 0, tensors[0].shape[0])

    def tensors(self) -> tuple:
        return tuple(t[self.i, : self.n] for t in self.src)


def whole_batch(rows: list[BatchRow]) -> tuple | None:
    """The source tensors, cut to len(rows) rows, when `rows` are rows 0, 1, ... of one step's
    tensors in order (the batch did not change); else None."""
    src = rows[0].src
    if all(r.src is src and r.i == i for i, r in enumerate(rows)):
        return tuple(t[: len(rows)] for t in src)
    return None


def pending_feed(rows: list[BatchRow]) -> Feed:
    """The drafters' pending rows as one Feed: an unchanged batch's are the last step's tensors as
    they are (no per-sequence views), a changed one's gathered."""
    whole = whole_batch(rows)
    return Feed(*whole, [r.n for r in rows]) if whole is not None else Feed.gather(rows)


@dataclass
class LiveSequence:
    req: Request
    cache: SequenceCache
    state: ProposerState | None
    out: list[int]
    acc: Acceptance
    t0: object
    all_tokens: list[int] = field(default_factory=list)  # prompt + every accepted token (untruncated)
    last: int = 0  # t[n]: newest accepted token, not yet in the target cache
    last_row: BatchRow | None = None  # that token on the device [1] (after a step without drafts: and its hidden)
    pend: BatchRow | None = None  # the drafter's pending rows: (tokens [n], hiddens [n, H])
    backlog: list[BatchRow] = field(default_factory=list)  # (token, hidden) rows of each step without drafts since the last drafting one
    done: str | None = None
    steps: int = 0
    res: SeqResult | None = None
    prefill_marks: tuple | None = None  # clock marks (start, end) of its admission's prefill
    records: list[StepRecord] = field(default_factory=list)  # one per verify step
    slot: int | None = None  # the engine slot it holds (its rows of the graphs' block tables)
    gen: torch.Generator | None = None  # its own random stream (sampling)
    arrive: object = None  # clock mark of the generate call that brought it
    grammar: object = None  # engine/grammar.SeqGrammar of a constrained request
    grammar_stop: int | None = None  # index in `out` after which its grammar admits nothing more

    @property
    def last_dev(self) -> torch.Tensor:
        row = self.last_row
        return row.src[0][row.i, : row.n]

    def join_backlog(self) -> None:
        """The rows of steps without drafts behind the pending ones. They wait as BatchRows, not
        views: a run that never drafts (gamma 0) makes no tensor per sequence and step for them."""
        if self.backlog:
            rows = [self.pend.tensors(), *(r.tensors() for r in self.backlog)]
            self.pend = BatchRow.own(torch.cat([t for t, _ in rows]), torch.cat([h for _, h in rows]))
            self.backlog = []

    def finalize(self, clock) -> None:
        """Its result's finish reason and times from its records (clock: the engine's marks)."""
        res = self.res
        res.finish_reason = self.done
        start, end = self.prefill_marks
        res.prefill_s = clock.seconds(start, end)
        res.queue_s = clock.seconds(self.arrive, start) if self.arrive is not None else 0.0
        res.ttft_s = res.queue_s + res.prefill_s
        decode = 0.0
        for r in self.records:
            prop, ver = r.times.read(clock)
            decode += prop + ver
            if r.drafts:
                res.propose_s.append(prop / r.drafts)
            res.verify_s.append(ver)
        res.decode_s = decode
        res.records = self.records


def budget_tokens(prompt_len: int, max_new_tokens: int, gamma: int) -> int:
    """Rows a request can reach in either cache: prompt + new tokens + the last verify's drafts."""
    return prompt_len + max_new_tokens + gamma


def reserve_tokens(prompt_len: int, max_new_tokens: int, gamma: int, alloc: str, max_seq_len: int) -> int:
    """Rows reserved per cache for one sequence: its budget, or the --max-seq-len ceiling."""
    return budget_tokens(prompt_len, max_new_tokens, gamma) if alloc == "budget" else max_seq_len
