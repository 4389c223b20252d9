"""Constrained decoding: one llguidance matcher per sequence, advanced speculatively over a step's
drafts and rolled back to what the verify accepted (vLLM's structured-output manager, llguidance's
LLMatcher).

Per step (speculate.SpecEngine._step), for the constrained sequences of the batch, `StepMasks`
holds the host bitmask [A, g + 1, W] (kernels/bitmask.py's packing; one sequence's rows contiguous,
the verify's layout): row i is the matcher's state after drafts d1..di, so verify position i is
masked by the state after the prefix before it. Each draft's copy to the host is queued the moment
drafting chooses it (`drafted`), so row i waits for draft i only, not for the whole chain. With
masked drafting (the default) row i is filled before draft i+1 is chosen, so the drafter's logits
are masked too: the host waits for each draft in turn. With --no-draft-mask only the verify is
masked: the whole chain and the verify forward are launched first, then row 0 (it needs no draft)
and each later row as its draft lands, so the walk overlaps drafting and the verify instead of
following them. A row's masks are computed on llguidance's thread pool, every sequence's at once.
A draft the grammar rejects ends the walk: the target's masked token replaces it, later rows stay
open (no position past it can be accepted). After the verdict each matcher rolls its walk back and consumes
the tokens the step emitted (`SeqGrammar.commit`): where the grammar then admits nothing more, the
sequence finishes (reason `grammar`).

End tokens: the tokenizer's EOS ids (the model's eos_token_id) are allowed by the mask only where
the grammar accepts. A token the engine ends on (its EOS set; empty under --ignore-eos) is not fed to
the matcher: the sequence stops there anyway; under --ignore-eos an EOS is consumed and completes
the grammar.

--constrain-after TOKEN: a sequence is unconstrained (masks all ones) until it emits that token,
and constrained from the next position, whether the token lands at a draft position or is a
verify's own token; a rollback past it unarms the sequence again.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from glm5mtp_cli.constraint import Constraint, llguidance
from kernels.bitmask import apply_bitmask, unpack, words

MATCHED, TRIGGER, FREE, END = "m", "t", "f", "e"  # what one walked token did (SeqGrammar.spec)


class Grammars:
    """An engine's matchers: the llguidance tokenizer, built from tokenizer.json's text at the first
    constrained request, and every live matcher counted (leak-check: freed with their sequences)."""

    def __init__(self, tokenizer_file: Path, vocab_size: int, eos_ids, trigger: int | None):
        self.tokenizer_file = tokenizer_file
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self.trigger = trigger
        self.words = words(vocab_size)
        self.live = 0
        self._tok = None
        self._grammars: dict[Constraint, str] = {}
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._executor = None
        self.threads = max(1, min(32, (os.cpu_count() or 1) * 4 // 5))  # llguidance's own default

    def tokenizer(self):
        if self._tok is None:
            self._tok = llguidance().LLTokenizer(self.tokenizer_file.read_text(), n_vocab=self.vocab_size,
                                                 eos_token=self.eos_ids)
        return self._tok

    def _matcher(self, c: Constraint):
        if c not in self._grammars:
            self._grammars[c] = c.grammar()
        m = llguidance().LLMatcher(self.tokenizer(), self._grammars[c], log_level=0)
        if m.is_error():  # checked before loading (Constraint.check); this is a tokenizer-specific failure
            raise RuntimeError(f"the {c.kind} grammar does not build over this tokenizer: {m.get_error()}")
        return m

    def open(self, c: Constraint, ends: set[int]) -> "SeqGrammar":
        """A sequence's matcher; ends: the tokens the engine stops on (never fed to the matcher)."""
        g = SeqGrammar(self, c, self._matcher(c), self.trigger, ends)
        self.live += 1
        return g

    def fill_rows(self, rows: torch.Tensor, members: list[tuple[object, int]]) -> None:
        """rows [..., W] int32 (host, contiguous), read as R rows of W: row r gets the mask of
        matcher m, for each (m, r) of members, computed on llguidance's thread pool (the matchers
        release the GIL): a batch's masks cost about one mask's time, not one per sequence (vLLM
        fills its bitmask the same way)."""
        if members:
            self.executor().unsafe_compute_mask_ptr(members, rows.data_ptr(), rows.shape[-1] * rows.element_size(),
                                                    rows.numel() // rows.shape[-1])

    def executor(self):
        if self._executor is None:
            self._executor = llguidance().LLExecutor(num_threads=self.threads)
        return self._executor

    def validates(self, c: Constraint, tokens: list[int]) -> bool:
        """Whether `tokens` are a complete match, by a fresh matcher (not the one that produced them)."""
        m = self._matcher(c)
        return m.consume_tokens(tokens) and m.is_accepting()

    def host_buffer(self, positions: int, rows: int, device: torch.device) -> torch.Tensor:
        """A [rows, positions, W] int32 host mask, all allowed; pinned for CUDA, reused (a step's
        copies are done by its one host read, before the next step refills it). One buffer per
        positions count, as long as the most rows it met, and smaller batches take its first rows:
        a batch that shrinks as its sequences finish allocates nothing (leak-check's census would
        count a buffer per (positions, rows) met after its warm-up as growth)."""
        buf = self._buffers.get(("masks", positions))
        if buf is None or buf.shape[0] < rows:
            buf = self._buffers["masks", positions] = torch.empty((rows, positions, self.words), dtype=torch.int32,
                                                                  pin_memory=device.type == "cuda")
        return buf[:rows].fill_(-1)

    def draft_buffer(self, positions: int, rows: int, device: torch.device) -> torch.Tensor:
        """[positions, rows] int64 host draft ids, reused as host_buffer's; a draft position's ids
        are contiguous, so each lands in one copy."""
        buf = self._buffers.get(("drafts", positions))
        if buf is None or buf.shape[1] < rows:
            buf = self._buffers["drafts", positions] = torch.empty((positions, rows), dtype=torch.long,
                                                                   pin_memory=device.type == "cuda")
        return buf[:, :rows]


class SeqGrammar:
    """One sequence's matcher and where its constrained part starts. `spec` lists the tokens walked
    since the last commit (what each did), so a rollback undoes exactly those."""

    def __init__(self, owner: Grammars, constraint: Constraint, matcher, trigger: int | None, ends: set[int]):
        self.owner, self.constraint, self.matcher = owner, constraint, matcher
        self.trigger, self.ends = trigger, ends
        self.armed = trigger is None
        self.ended = False
        self.spec: list[str] = []
        self.emitted = 0  # tokens committed
        self.start = 0 if self.armed else None  # output index where the constrained part starts

    @property
    def masking(self) -> bool:
        """Whether its next token is masked (else all are allowed: before the trigger, after an end)."""
        return self.armed and not self.ended

    def advance(self, tok: int) -> bool:
        """Walk one token; False (nothing changed) where the grammar rejects it."""
        if self.ended:
            return False
        if tok in self.ends:
            if self.armed and not self.matcher.is_accepting():
                return False
            self.ended = True
            self.spec.append(END)
        elif not self.armed:
            self.armed = tok == self.trigger
            self.spec.append(TRIGGER if self.armed else FREE)
        elif self.matcher.try_consume_tokens([tok]) == 1:
            self.spec.append(MATCHED)
        else:
            return False
        return True

    def rollback(self) -> None:
        """Undo every token walked since the last commit."""
        n = self.spec.count(MATCHED)
        if n:
            self.matcher.rollback(n)
        if TRIGGER in self.spec:
            self.armed = False
        if END in self.spec:
            self.ended = False
        self.spec = []

    def commit(self, new: list[int]) -> int | None:
        """The step's emitted tokens replace its walk. Returns the index in `new` after which the
        grammar admits nothing more (the sequence ends there), or None."""
        self.rollback()
        for j, tok in enumerate(new):
            if not self.advance(tok):
                raise RuntimeError(f"the grammar rejected emitted token {tok}: a mask was not applied")
            kind = self.spec[-1]
            if kind == TRIGGER:
                self.start = self.emitted + j + 1
            if kind == END or (kind == MATCHED and self.matcher.is_stopped()):
                self.spec = []
                self.emitted += j + 1
                return j if kind == MATCHED else None
        self.spec = []
        self.emitted += len(new)
        return None

    def constrained_part(self, out: list[int]) -> list[int] | None:
        """The tokens of `out` the constraint covers (None: its trigger never came), end tokens dropped."""
        if self.start is None:
            return None
        return [t for t in out[self.start:] if t not in self.ends]

    def free(self) -> None:
        if self.matcher is not None:
            self.matcher = None
            self.owner.live -= 1


class StepMasks:
    """One step's masks for the batch's constrained sequences (the module docstring): rows filled
    on the host as the drafts before them land, then copied to the device per draft position
    (masked drafting) or whole (the verify's)."""

    def __init__(self, grammars: Grammars, seqs: list[SeqGrammar | None], gamma: int, device: torch.device,
                 mask_drafts: bool):
        self.seqs = seqs
        self.grammars = grammars
        self.device = device
        self.mask_drafts = mask_drafts
        self.host = grammars.host_buffer(gamma + 1, len(seqs), device)  # [A, gamma + 1, W]
        self.drafts = grammars.draft_buffer(gamma, len(seqs), device)  # [gamma, A]: column i of the drafts
        self.landed: list[torch.cuda.Event | None] = []  # per draft position queued: its copy's event
        self.vocab_size = grammars.vocab_size
        self.ok = [g is not None for g in seqs]  # still walking: every draft so far allowed
        self.valid = [0 if g is not None else None for g in seqs]  # drafts the grammar allowed
        self.filled = 0  # positions whose rows are filled

    def drafted(self, d: torch.Tensor) -> None:
        """The next draft position's ids [A] are chosen (on the device): their copy to the host is
        queued now, before the next forward is launched, so the row after them waits for them
        alone (the one host read of each draft)."""
        i = len(self.landed)
        self.drafts[i].copy_(d, non_blocking=True)
        done = None
        if d.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        self.landed.append(done)

    def _column(self, i: int) -> list[int]:
        """Draft i + 1 of every sequence, waiting for its copy only."""
        done = self.landed[i]
        if done is not None:
            done.synchronize()
        return self.drafts[i].tolist()

    def _fill_row(self, i: int, counts: list[int] | None = None) -> None:
        """Row i: each walking sequence advanced by its draft i (none for row 0), then the masks of
        those still walking, in parallel."""
        col = self._column(i - 1) if i else None
        members = []
        positions = self.host.shape[1]
        for b, g in enumerate(self.seqs):
            if not self.ok[b]:
                continue
            if col is not None:
                if (counts is not None and i > counts[b]) or not g.advance(col[b]):
                    self.ok[b] = False
                    continue
                self.valid[b] += 1
            if g.masking:
                members.append((g.matcher, b * positions + i))
        self.grammars.fill_rows(self.host, members)
        self.filled = i + 1

    def draft(self, i: int, logits: torch.Tensor, subset=None) -> torch.Tensor:
        """Draft position i's logits [A, V'] masked by the state after drafts 1..i (the host waits
        for draft i here). subset: the proposer's --draft-vocab head, whose logit j is token
        subset.ids[j]."""
        self._fill_row(i)
        mask = self.host[:, i].to(self.device, non_blocking=True)
        if subset is None:
            return apply_bitmask(logits, mask)
        allowed = unpack(mask, self.vocab_size).index_select(-1, subset.ids)
        allowed |= ~allowed.any(-1, keepdim=True)  # no allowed token among the K: that row drafts unmasked
        return logits.masked_fill(~allowed, float("-inf"))

    def verify(self, drafts) -> torch.Tensor:
        """The verify's masks [A, k + 1, W] on the device (k: the drafts' columns, 0 without drafts):
        the rows drafting did not fill, each as soon as its draft is on the host."""
        k = drafts.tokens.shape[1] if drafts is not None else 0
        for i in range(self.filled, k + 1):
            self._fill_row(i, drafts.counts if k else None)
        for b, n in enumerate(self.valid):  # drafting may have walked past a confidence stop
            if n is not None and drafts is not None:
                self.valid[b] = min(n, drafts.counts[b])
        return self.host[:, : k + 1].to(self.device, non_blocking=True)
