"""Constrained decoding: one llguidance matcher per sequence, advanced speculatively over a step's
drafts and rolled back to what the verify accepted (vLLM's structured-output manager, llguidance's
LLMatcher).

Per step (speculate.SpecEngine._step), for the constrained sequences of the batch, `StepMasks`
holds the host bitmask [A, g + 1, W] (kernels/bitmask.py's packing; one sequence's rows contiguous,
the verify's layout): row i is the matcher's state after drafts d1..di, so verify position i is
masked by the state after the prefix before it. With masked drafting (the default) row i is filled
before draft i+1 is chosen, so the drafter's logits are masked too: each draft's copy to the host
is queued the moment it is chosen, before the next forward is launched, so the row after it waits
for that draft alone. With --no-draft-mask only the verify is masked: the drafts are read once
(their copy queued before the verify is launched), and every row is filled while the verify
forward runs: each matcher walks its drafts from row 0, filling a row per position, and ends where
it started, where the walk needs nothing of the engine's own (no end token among the drafts,
already constrained). Up to ON_CALLER sequences' masks are computed on this thread, more on
llguidance's thread pool in one call; there a walk, a chain of masks one after another, is cut into
pieces that start from copies of the matcher advanced to their first row where the pool has threads
to spare.
A draft the grammar rejects ends the walk: the target's masked token replaces it, later rows stay
open (no position past it can be accepted). After the verdict each matcher rolls its walk back and consumes
the tokens the step emitted (`SeqGrammar.commit`): where the grammar then admits nothing more, the
sequence finishes (reason `grammar`).

End tokens: the tokenizer's EOS ids (the model's eos_token_id) are allowed by the mask only where
the grammar accepts, llguidance's rule. Any other token the engine ends on (its EOS set beyond the
model's: leak-check declares such a token for a round) has its bit cleared where the matcher does
not accept: the engine would end there on a token it reads as an end, not content. Sequences with
such tokens fill their rows one by one, where the matcher's state is known. A token the engine ends on
(its EOS set; empty under --ignore-eos) is not fed to the matcher: the sequence stops there anyway;
under --ignore-eos an EOS is consumed and completes the grammar.

--constrain-after TOKEN: a sequence is unconstrained (masks all ones) until it emits that token,
and constrained from the next position, whether the token lands at a draft position or is a
verify's own token; a rollback past it unarms the sequence again.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from glm5mtp_cli.constraint import Constraint, llguidance
from glm5mtp_cli.engine.hooks import watch
from kernels.bitmask import apply_bitmask, unpack, words

MATCHED, TRIGGER, FREE, END = "m", "t", "f", "e"  # what one walked token did (SeqGrammar.spec)
TEMPLATES = 64  # distinct constraints an engine keeps compiled (Grammars._matcher)
# Masks of at most this many matchers are computed on the calling thread: at batch 8 on an H100 host
# a call on llguidance's pool (its threads woken and joined) cost more than the masks it spread
# (profiles/constrained/RESULTS.md, "Masks on the calling thread")
ON_CALLER = 8


class Grammars:
    """An engine's matchers: the llguidance tokenizer, built from tokenizer.json's text at the first
    constrained request; a compiled template per constraint, which sequences' matchers are copies
    of (`_matcher`, `retire`); and every live matcher counted (leak-check: freed with their
    sequences)."""

    def __init__(self, tokenizer_file: Path, vocab_size: int, eos_ids, trigger: int | None):
        self.tokenizer_file = tokenizer_file
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self.trigger = trigger
        self.words = words(vocab_size)
        self.live = 0
        self._tok = None
        self._templates: dict[Constraint, object] = {}  # compiled matchers, least recently used first
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._executors: dict[int, object] = {}
        self.threads = max(1, min(32, (os.cpu_count() or 1) * 4 // 5))  # the most: llguidance's own default

    def tokenizer(self):
        if self._tok is None:
            self._tok = llguidance().LLTokenizer(self.tokenizer_file.read_text(), n_vocab=self.vocab_size,
                                                 eos_token=self.eos_ids)
        return self._tok

    def _matcher(self, c: Constraint):
        """A matcher at the start of c's grammar: a copy of c's template, compiled at its first
        request. Compiling one costs 0.6-1.8 ms on the CI machine's CPU, a copy 3-20 µs; the copy
        also starts with the template's lexer states, built by its first mask and by the replies
        of the sequences it retired (llguidance's deep copy clones them: copies share no lock). At
        most TEMPLATES are kept."""
        t = self._templates.pop(c, None)
        if t is None:
            t = llguidance().LLMatcher(self.tokenizer(), c.grammar(), log_level=0)
            t.compute_bitmask()  # builds the lexer states its copies start from; the state stays
            if t.is_error():  # checked before loading (Constraint.check); this is a tokenizer-specific failure
                raise RuntimeError(f"the {c.kind} grammar does not build over this tokenizer: {t.get_error()}")
        self._templates[c] = t  # now the most recently used
        if len(self._templates) > TEMPLATES:
            del self._templates[next(iter(self._templates))]
        return t.deep_copy()

    def retire(self, c: Constraint, m) -> None:
        """A freed sequence's matcher, reset to the grammar's start, becomes c's template while c's
        is kept: its lexer states, built along the whole reply, are where the next copies start
        (a walk of the function-call object costs half its masks' time from them)."""
        if c in self._templates:
            m.reset()
            if not m.is_error():
                self._templates[c] = m

    def open(self, c: Constraint, ends: set[int]) -> "SeqGrammar":
        """A sequence's matcher; ends: the tokens the engine stops on (never fed to the matcher)."""
        g = SeqGrammar(self, c, self._matcher(c), self.trigger, ends, sorted(set(ends) - set(self.eos_ids)))
        self.live += 1
        return g

    def fill_rows(self, rows: torch.Tensor, members: list[tuple[object, int]]) -> None:
        """rows [..., W] int32 (host, contiguous), read as R rows of W: row r gets the mask of
        matcher m, for each (m, r) of members. Up to ON_CALLER members on this thread, one after
        another; more in one call on llguidance's thread pool (the matchers release the GIL), where
        a batch's masks cost about one mask's time, not one per sequence (vLLM fills its bitmask
        the same way)."""
        if len(members) <= ON_CALLER:
            for m, r in members:
                _mask_into(m, rows, r)
        else:
            self.executor(len(members)).unsafe_compute_mask_ptr(
                members, rows.data_ptr(), rows.shape[-1] * rows.element_size(), rows.numel() // rows.shape[-1])

    def fill_walks(self, rows: torch.Tensor, members: list[tuple[object, int, list[int]]]) -> None:
        """rows as fill_rows'; for each (m, r, tokens) of members, row r gets matcher m's mask and
        rows r + 1.. the masks after each of `tokens` in turn, up to the first the grammar rejects
        (its row and those after it are left as they were); m ends where it started. Up to
        ON_CALLER members on this thread (`_walk`); more in one call on the thread pool
        (llguidance's speculative walk), each walk cut into pieces of about rows / threads masks
        (`_pieces`)."""
        if len(members) <= ON_CALLER:
            for m, r, toks in members:
                _walk(m, rows, r, toks)
            return
        per = max(2, -(-sum(len(toks) + 1 for _, _, toks in members) // self.threads))
        pieces = [p for m, r, toks in members if toks for p in _pieces(m, r, toks, per)]
        if pieces:
            self.executor(len(pieces)).unsafe_compute_mask_ptr_with_draft_token(
                pieces, rows.data_ptr(), rows.shape[-1] * rows.element_size(), rows.numel() // rows.shape[-1])
        self.fill_rows(rows, [(m, r) for m, r, toks in members if not toks])  # a walk needs a token

    def executor(self, items: int):
        """llguidance's thread pool for a call of `items` masks or walks (more than ON_CALLER
        members): two items a thread at the least, in powers of two up to `threads`. Idle threads
        are not free: on an H100 host's 16 cores a batch-8 walk (8 pieces) took 0.40 ms on 4
        threads and 0.54 ms on 12 (tests/grammar_host_cost.py, before such walks moved to the
        calling thread)."""
        n = min(self.threads, 1 << max(0, (items // 2).bit_length() - 1))
        if n not in self._executors:
            self._executors[n] = llguidance().LLExecutor(num_threads=n)
        return self._executors[n]

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

    def draft_buffer(self, positions: int, rows: int, device: torch.device, by_sequence: bool = False) -> torch.Tensor:
        """Host draft ids, int64, contiguous, reused as host_buffer's: [positions, rows] (masked
        drafting copies one position at a time), or by_sequence [rows, positions] (the drafts read
        whole: a copy of the device's [A, g] as it is, where the other layout's transposed copy
        first made a contiguous copy on the device, a launch and an allocation a step)."""
        key = ("drafts", positions, by_sequence)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < positions * rows:
            buf = self._buffers[key] = torch.empty(positions * rows, dtype=torch.long, pin_memory=device.type == "cuda")
        return buf[: positions * rows].view(*((rows, positions) if by_sequence else (positions, rows)))


def _mask_into(m, rows: torch.Tensor, r: int) -> None:
    """Matcher m's mask into row r of rows (fill_rows' layout), on this thread."""
    size = rows.shape[-1] * rows.element_size()
    m.unsafe_compute_mask_ptr(rows.data_ptr() + r * size, size)


def _walk(m, rows: torch.Tensor, r: int, tokens: list[int]) -> None:
    """One member of fill_walks on this thread: m's mask into row r, then after each of tokens in
    turn into the rows after it, up to the first the grammar rejects; m rolled back."""
    _mask_into(m, rows, r)
    n = 0
    for tok in tokens:
        if m.try_consume_tokens([tok]) != 1:
            break
        n += 1
        _mask_into(m, rows, r + n)
    if n:
        m.rollback(n)


def _clear_bits(row: torch.Tensor, ids: list[int]) -> None:
    """Clear the bits of token ids in a packed host mask row [W] int32."""
    words_ = row.numpy().view(np.uint32)
    for t in ids:
        words_[t >> 5] &= ~np.uint32(1 << (t & 31))


def _pieces(m, r: int, tokens: list[int], per: int) -> list[tuple[object, int, list[int]]]:
    """The walk (m, r, tokens), tokens not empty, as walks of `per` rows (per >= 2; a lone last row
    joins the piece before it, as a walk needs a token): the first m's own, each later one a copy of
    the matcher advanced to its first row (a copy and a consume cost a few microseconds, a mask tens).
    A token the grammar rejects ends the pieces: the piece before it stops there too."""
    n = len(tokens)
    starts = list(range(0, n + 1, per))
    if starts[-1] == n:
        starts.pop()
    pieces, prev = [], 0
    for a, end in zip(starts, starts[1:] + [n + 1]):
        if a:
            m = m.deep_copy()
            if m.try_consume_tokens(tokens[prev:a]) != a - prev:
                break
        pieces.append((m, r + a, tokens[a:end - 1]))
        prev = a
    return pieces


class SeqGrammar:
    """One sequence's matcher and where its constrained part starts. `spec` lists the tokens walked
    since the last commit (what each did), so a rollback undoes exactly those."""

    PHASES = {"grammar.commit": "commit"}  # as observers see them (engine/hooks.py)

    def __init__(self, owner: Grammars, constraint: Constraint, matcher, trigger: int | None, ends: set[int],
                 own_ends: list[int]):
        self.owner, self.constraint, self.matcher = owner, constraint, matcher
        self.trigger, self.ends = trigger, ends
        self.own_ends = own_ends  # the engine's end tokens llguidance does not know as EOS
        self.enders = set(ends) | set(owner.eos_ids)  # every token that may end the sequence or its grammar
        self.armed = trigger is None
        self.ended = False
        self.spec: list[str] = []
        self.emitted = 0  # tokens committed
        self.start = 0 if self.armed else None  # output index where the constrained part starts
        watch(self)

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
        if self.masking and self.enders.isdisjoint(new):
            return self._consume(new)
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

    def _consume(self, new: list[int]) -> int | None:
        """commit's common case (armed, no end token among the tokens): the step's tokens in one
        call to the matcher, not one call and its bookkeeping per token. Where the grammar stops,
        the tokens after it are not fed, as in the token-by-token path."""
        n = self.matcher.try_consume_tokens(new)
        stopped = self.matcher.is_stopped()
        if n < len(new) and not (n and stopped):
            raise RuntimeError(f"the grammar rejected emitted token {new[n]}: a mask was not applied")
        self.emitted += n
        return n - 1 if stopped else None

    def constrained_part(self, out: list[int]) -> list[int] | None:
        """The tokens of `out` the constraint covers (None: its trigger never came), end tokens dropped."""
        if self.start is None:
            return None
        return [t for t in out[self.start:] if t not in self.ends]

    def free(self) -> None:
        if self.matcher is not None:
            self.owner.retire(self.constraint, self.matcher)
            self.matcher = None
            self.owner.live -= 1


class StepMasks:
    """One step's masks for the batch's constrained sequences (the module docstring): rows filled
    on the host, position by position while drafting, else in one walk before the verify; then
    copied to the device per draft position or whole. The drafts reach the host through pinned
    buffers, each position's copy queued as soon as it is chosen (`drafted`), or all of them in one
    copy where the fused chain chose them together."""

    PHASES = {"masks.read_drafts": "read_drafts", "masks.verify": "verify"}  # as observers see them

    def __init__(self, grammars: Grammars, seqs: list[SeqGrammar | None], gamma: int, device: torch.device):
        self.seqs = seqs
        self.grammars = grammars
        self.device = device
        self.host = grammars.host_buffer(gamma + 1, len(seqs), device)  # [A, gamma + 1, W]
        self.drafts = grammars.draft_buffer(gamma, len(seqs), device)  # [gamma, A]: draft i + 1 of each
        self.whole: torch.Tensor | None = None  # [A, g]: every draft of each, where they were read in one copy
        self.landed: list[torch.cuda.Event | None] = []  # per draft position queued: its copy's event
        self.vocab_size = grammars.vocab_size
        self.ok = [g is not None for g in seqs]  # still walking: every draft so far allowed
        self.valid = [0 if g is not None else None for g in seqs]  # drafts the grammar allowed
        self.filled = 0  # positions whose rows are filled
        watch(self)

    def _fill_row(self, i: int, col: list[int] | None, counts: list[int] | None = None) -> None:
        """Row i: each walking sequence advanced by its draft i (col, host ids; None for row 0), then
        the masks of those still walking, in parallel."""
        members, own_ends = [], []
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
                if g.own_ends and not g.matcher.is_accepting():
                    own_ends.append((b, g.own_ends))
        self.grammars.fill_rows(self.host, members)
        for b, ends in own_ends:  # no ending on them before the grammar accepts
            _clear_bits(self.host[b, i], ends)
        self.filled = i + 1

    def drafted(self, cols: torch.Tensor) -> None:
        """The next draft positions' ids [A, n], chosen on the device: their copy to the host is
        queued now, before another forward is launched, so a read of them waits for them alone."""
        i, n = len(self.landed), cols.shape[1]
        self.drafts[i:i + n].copy_(cols.T, non_blocking=True)
        self._queued(cols.device, n)

    def _queued(self, device: torch.device, n: int) -> None:
        """n more draft positions' copies queued: their event (None off CUDA: the copy is done)."""
        done = None
        if device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        self.landed += [done] * n

    def _read(self, first: int, k: int) -> list[list[int]]:
        """Drafts first + 1..k of each sequence on the host, waiting for their copies only."""
        done = self.landed[k - 1]  # queued last: the copies before it are done too
        if done is not None:
            done.synchronize()
        if self.whole is not None:
            return self.whole[:, first:k].tolist()
        return self.drafts[first:k].T.tolist()

    def draft(self, i: int, logits: torch.Tensor, subset=None) -> torch.Tensor:
        """Draft position i's logits [A, V'] masked by the state after drafts 1..i (the host waits
        for draft i here). subset: the proposer's --draft-vocab head, whose logit j is token
        subset.ids[j]."""
        self._fill_row(i, [c[0] for c in self._read(i - 1, i)] if i else None)
        mask = self.host[:, i].to(self.device, non_blocking=True)
        if subset is None:
            return apply_bitmask(logits, mask)
        allowed = unpack(mask, self.vocab_size).index_select(-1, subset.ids)
        allowed |= ~allowed.any(-1, keepdim=True)  # no allowed token among the K: that row drafts unmasked
        return logits.masked_fill(~allowed, float("-inf"))

    def read_drafts(self, drafts) -> None:
        """Queue the copy of the drafts drafting did not hand over (the fused chain's, unmasked)
        before the verify forward is launched: then `verify`'s read waits for drafting only, and
        the walk overlaps the verify forward (a read enqueued after it would wait for the whole
        verify)."""
        k = drafts.tokens.shape[1] if drafts is not None else 0
        if k and not self.landed:  # every draft at once: copied as the device holds them, [A, k]
            self.whole = self.grammars.draft_buffer(k, drafts.tokens.shape[0], self.device, by_sequence=True)
            self.whole.copy_(drafts.tokens, non_blocking=True)
            self._queued(drafts.tokens.device, k)
        elif len(self.landed) < k:
            self.drafted(drafts.tokens[:, len(self.landed):k])

    def verify(self, drafts) -> torch.Tensor:
        """The verify's masks [A, k + 1, W] on the host (k: the drafts' columns, 0 without drafts):
        the rows drafting did not fill, filled now from the drafts' copies (`read_drafts`)."""
        k = drafts.tokens.shape[1] if drafts is not None else 0
        counts = drafts.counts if k else None
        if self.filled <= k:
            first = max(self.filled - 1, 0)  # the draft column before the first row still to fill
            cols = self._read(first, k) if k else []
            if self.filled == 0:  # drafting masked nothing: the walk, from row 0
                self._walk_plain(cols, counts)
                self._fill_row(0, None)  # the other sequences' row 0
            for i in range(self.filled, k + 1):
                self._fill_row(i, [c[i - 1 - first] for c in cols], counts)
        for b, n in enumerate(self.valid):  # drafting may have walked past a confidence stop
            if n is not None and drafts is not None:
                self.valid[b] = min(n, drafts.counts[b])
        return self.host[:, : k + 1]

    def _walk_plain(self, cols: list[list[int]], counts: list[int] | None) -> None:
        """Rows 0.. of the sequences whose walk needs nothing of the engine's (constrained, drafts
        and no end token among them, no end tokens of the engine's own) in one call
        (Grammars.fill_walks), their allowed drafts counted from the rows; the rest are left
        walking for the row by row fill. The matchers end where they started."""
        members = []
        positions = self.host.shape[1]
        for b, g in enumerate(self.seqs):
            toks = cols[b][: counts[b]] if counts is not None else []
            if g is None or not toks or not g.masking or g.own_ends or g.ends.intersection(toks):
                continue
            self.ok[b] = False  # walked here
            members.append((g.matcher, b * positions, toks))
        self.grammars.fill_walks(self.host, members)
        rows = self.host.numpy()
        for _, r, toks in members:
            b, n = r // positions, 0
            while n < len(toks) and rows[b, n, toks[n] >> 5] >> (toks[n] & 31) & 1:
                n += 1  # draft n + 1 is allowed by the row before it
            self.valid[b] = n


def step_masks(grammars: Grammars | None, seqs: list, gamma: int, device) -> StepMasks | None:
    """A step's masks for the sequences `seqs` (engine sequences, each with its matcher or None), or None
    when none of them is constrained."""
    if grammars is None or all(s.grammar is None for s in seqs):
        return None
    return StepMasks(grammars, [s.grammar for s in seqs], gamma, device)
