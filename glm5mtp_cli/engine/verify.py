"""A verify's shape (VerifyPlan) and what one verify returns (VerifyRecord).

A plan names the rows one verify checks for every sequence of a batch: row 0 is the sequence's newest
token, each further row a draft, and parents[i] the row whose next token row i's draft claims to be.
A chain of g drafts is parents (-1, 0, 1, ..., g - 1); a tree branches (several rows share a parent).
A row sits at the sequence's length plus its depth, and sees the cached rows and its ancestors only.
What a verify accepts is a path from row 0: the longest whose every draft is the target's token at its
parent. Commit keeps that path's rows as the sequence's next rows: a chain's path is a prefix (the
rows stay where they are), a tree's is gathered into place.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class VerifyPlan:
    parents: tuple[int, ...]  # per row: -1 for row 0, else an earlier row

    def __post_init__(self):
        if not self.parents or self.parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(self.parents) if i):
            raise ValueError(f"a verify plan's rows name earlier rows as parents, row 0 none: {self.parents}")

    @classmethod
    def chain(cls, drafts: int) -> "VerifyPlan":
        return cls((-1, *range(drafts)))

    @classmethod
    def tree(cls, children: tuple[int, ...]) -> "VerifyPlan":
        """Every row at depth d has children[d] children, rows in breadth-first order: (2, 1) is two
        branches of two drafts each, 5 rows; a chain of g drafts is (1,) * g."""
        parents, frontier = [-1], [0]
        for k in children:
            nxt = []
            for p in frontier:
                nxt += range(len(parents), len(parents) + k)
                parents += [p] * k
            frontier = nxt
        return cls(tuple(parents))

    @property
    def rows(self) -> int:
        return len(self.parents)

    @property
    def drafts(self) -> int:
        return len(self.parents) - 1

    @cached_property
    def is_chain(self) -> bool:
        return self.parents == tuple(range(-1, self.rows - 1))

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """Each row's depth: its offset past the sequence's length."""
        out = []
        for p in self.parents:
            out.append(0 if p < 0 else out[p] + 1)
        return tuple(out)

    @property
    def depth(self) -> int:
        """The longest path's drafts: the most a verify can accept."""
        return max(self.depths)

    @cached_property
    def paths(self) -> tuple[tuple[int, ...], ...]:
        """Each row's path from row 0, row 0 left out: its ancestors at depths 1..depth and itself,
        padded with 0 past its own depth (a verdict's path rows, as tree_verdict writes them)."""
        out = []
        for r in range(self.rows):
            path = []
            while r > 0:
                path.append(r)
                r = self.parents[r]
            out.append(tuple(path[::-1]) + (0,) * (self.depth - len(path)))
        return tuple(out)


@dataclass
class VerifyRecord:
    """What one verify returned, passed whole to the accept and the commit (the runner keeps nothing
    of it): logits [A, T, V] and hidden rows [A, T, H]; the target's commit records of fixed-size state
    (`pending`, None without) and the static commit that writes them (None: the target's own, eager);
    the verdict rows when the verify decided them on the device (a greedy static verify's, or its
    masked replay's), else None; the masked verdict's static replay, where one was captured."""

    plan: VerifyPlan
    logits: torch.Tensor
    hidden_all: torch.Tensor
    target: object
    pending: object = None
    committer: object = None
    verdict: torch.Tensor | None = None
    masked: object = None

    def commit(self, last_row: torch.Tensor) -> None:
        """The fixed-size state keeps each sequence's rows through its accepted path's last row
        (last_row [A] on the device: a chain's accepted count); a bucket's padding rows keep none."""
        if self.pending is None:
            return
        if self.committer is None:
            self.target.commit(self.pending, last_row + 1)
        else:
            self.committer.run(self.pending, last_row)
