"""MtpHead: a model family's MTP layer as a DraftProposer (REFERENCE.md section 4; GLM-5-Next's
section 9 is the same skeleton). The layer is the family's: it appends drafter rows over the
drafter's SequenceCaches (`layer(...)`), runs the same as a function of a context
(`forward_batch`, `context`), and returns logits, the post-norm hidden and the pre-norm one.

A propose call first appends the sequence's pending real rows (tokens accepted since the last call,
each paired with the target hidden of the position before it) in one forward; the last of those
rows yields draft 1. Each further draft feeds the previous draft with the drafter's own hidden:
post-shared_head.norm `g` for GLM (carrying the pre-norm `y` collapses acceptance after the first
position), pre-norm when the config asks for DeepSeek's chaining.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from glm5mtp_cli.engine.cache import CachePools
from glm5mtp_cli.engine.config import EngineConfig
from glm5mtp_cli.engine.draft_vocab import SubsetHead
from glm5mtp_cli.engine.graphs import BatchRows, ForwardRunner
from glm5mtp_cli.engine.prefill import padded_feed, plan_forwards
from glm5mtp_cli.engine.proposer import CatchupMisaligned, DrafterKV, Drafts, ProposerState
from glm5mtp_cli.engine.sampling import choose
from glm5mtp_cli.errors import UserError


class MtpHead:
    def __init__(self, layer: nn.Module, embed: nn.Embedding, head: nn.Linear, pools: CachePools,
                 config: EngineConfig, draft_ids: torch.Tensor | None = None, carry_normed: bool = True):
        """config: the engine's (sampling, draft_conf_tau, max_seq_len: the rows a state may reserve);
        draft_ids: --draft-vocab's token ids; carry_normed: chain on the post-norm hidden (GLM),
        else the pre-norm one (DeepSeek)."""
        self.layer = layer
        self.embed = embed
        self.head = head
        # --draft-vocab: chain steps score only these tokens (a catch-up row's logits are unused
        # except the last, which drafts too, so every drafting forward uses the subset head)
        self.draft_head = SubsetHead(head, draft_ids) if draft_ids is not None else None
        self.pools = pools
        self.max_seq_len = config.max_seq_len
        self.sampling = config.sampling
        self.tau = config.draft_conf_tau
        # the proposer's own stream serves only direct propose() calls: the engine's requests each
        # bring theirs (sampling.request_stream)
        self.gen = torch.Generator(device=embed.weight.device).manual_seed(config.sampling.seed)
        self.carry_normed = carry_normed

    # ---- state ------------------------------------------------------------------------------
    def alloc_state(self) -> ProposerState:
        """Ceiling allocation: rows for --max-seq-len tokens, whatever the request needs."""
        return self.alloc_state_for(self.max_seq_len)

    def alloc_state_for(self, budget_tokens: int) -> ProposerState:
        if budget_tokens > self.max_seq_len:
            raise UserError(f"request needs {budget_tokens} drafter rows, over --max-seq-len {self.max_seq_len}")
        cache = self.pools.drafter_cache()
        try:
            cache.reserve(budget_tokens)
        except Exception:
            cache.release()
            raise
        return ProposerState(cache, budget_tokens)

    def free_state(self, state: ProposerState) -> None:
        if state.cache is not None:
            state.cache.release()
            state.cache = None

    def drafter_rows(self, state: ProposerState) -> int:
        return state.cache.length

    # ---- filling ----------------------------------------------------------------------------
    def catchup_drafter(self, tokens: torch.Tensor, hiddens: torch.Tensor, row_base: int,
                        state: ProposerState) -> None:
        """Append real rows row_base.. for accepted tokens; refuse a feed that would leave a gap."""
        self._check_aligned(row_base, state)
        if tokens.shape[0]:
            self.layer(tokens[None], hiddens[None], [state.cache], self.embed, self.head, rows="last")
            self._mark_real(state, tokens.shape[0], tokens)

    def catchup_batch(self, tokens: list[torch.Tensor], hiddens: list[torch.Tensor], states: list[ProposerState],
                      chunk: int, budget: int, static=None) -> None:
        """Append each state's real rows tokens[b] (with hiddens[b]) from its current length, in
        forwards shared by several sequences (engine/prefill.py: the drafters' caches are paged rows);
        `static` (engine/prefill_graphs.PrefillForwards) runs the forwards it has a bucket for."""
        for st in states:
            self._check_aligned(st.cache.length if st.cache is not None else -1, st)
        caches = [st.cache for st in states]
        done = [0] * len(states)
        plan = plan_forwards([t.shape[0] for t in tokens], [c.capacity - c.length for c in caches], chunk, budget)
        for t, members in plan:
            toks = [tokens[i][done[i]:done[i] + k] for i, k in members]
            ids, hid = padded_feed(toks, [hiddens[i][done[i]:done[i] + k] for i, k in members], t)
            group = [caches[i] for i, _ in members]
            if static is None or not static.drafter(ids, hid, group, [k for _, k in members]):
                starts = [c.length for c in group]
                self.layer(ids, hid, group, self.embed, self.head, rows="last")
                for j, (_, k) in enumerate(members):
                    if k < t:
                        group[j].truncate(starts[j] + k)  # padding rows: overwritten by the next append
            for j, (i, k) in enumerate(members):
                self._mark_real(states[i], k, toks[j])
                done[i] += k

    def _check_aligned(self, row_base: int, state: ProposerState) -> None:
        if state.cache is None:
            raise CatchupMisaligned("drafter state was freed or its KV taken")
        if row_base != state.cache.length or state.real_rows != state.cache.length:
            raise CatchupMisaligned(
                f"catch-up starts at row {row_base}, but the drafter holds {state.cache.length} rows "
                f"({state.real_rows} real): call after_verify first and feed from drafter_rows()")

    @staticmethod
    def _mark_real(state: ProposerState, n: int, tokens) -> None:
        """n real rows went in; tokens: their ids on the device (reading them back would sync every
        step), or (BatchRows, j), made a tensor only if read (a carry's take_drafter_kv)."""
        state.real_rows += n
        state.row_tokens.append(tokens)

    def _mark_fed(self, states: list[ProposerState], tokens) -> None:
        """Each state's pending rows went into the drafter (tokens: a list of tensors, or BatchRows)."""
        if isinstance(tokens, BatchRows):
            for j, (st, n) in enumerate(zip(states, tokens.lengths)):
                self._mark_real(st, n, (tokens, j))
        else:
            for st, tok in zip(states, tokens):
                self._mark_real(st, tok.shape[0], tok)

    # ---- the drafting math, as functions of device tensors (eager, static and captured alike) ----
    def context(self, starts: torch.Tensor, t: int, rows: dict):
        return self.layer.context(starts, t, rows)

    def drafter_forward(self, ids: torch.Tensor, hidden: torch.Tensor, ctx, rows: str | torch.Tensor):
        """Drafter rows ids [B, T] with hiddens [B, T, H] -> (logits [B, V'] and the hidden carried
        to the next draft [B, H], both at each sequence's row `rows`): V' is the draft vocabulary."""
        out = self.layer.forward_batch(ids, hidden, ctx, self.embed, self.draft_head or self.head, rows)
        carried = out.hidden if self.carry_normed else out.prenorm
        return out.logits[:, -1], carried[:, -1]

    def greedy_chain(self, ids, hidden, starts, last_real, context_at, gamma: int) -> torch.Tensor:
        """Greedy drafts [B, gamma] in one pass (what the fused graph captures): the catch-up rows
        (row last_real[b] is sequence b's last real one) draft d1, then each further draft feeds
        the previous one with the carried hidden, one row at a time, argmax inside."""
        logits, carried = self.drafter_forward(ids, hidden, context_at(starts, ids.shape[1]), last_real)
        drafts = [self._full_ids(logits.argmax(-1))]
        starts = starts + last_real + 1  # each sequence's first chain row: right after its real rows
        for _ in range(gamma - 1):
            with self.chained():
                logits, carried = self.drafter_forward(drafts[-1][:, None], carried[:, None], context_at(starts, 1),
                                                       "last")
            drafts.append(self._full_ids(logits.argmax(-1)))
            starts = starts + 1
        return torch.stack(drafts, dim=1)

    def _full_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self.draft_head.to_full(ids) if self.draft_head is not None else ids

    # ---- drafting ---------------------------------------------------------------------------
    def propose_batch(self, tokens, hiddens, positions: list[int], num_drafts: int, states: list[ProposerState],
                      runner: ForwardRunner, grammar=None) -> Drafts:
        """Drafts for many sequences. tokens[b]/hiddens[b] (lists, or graphs.BatchRows): the pending
        real rows of sequence b (at least one: the newest accepted token and the target hidden
        before it), starting at drafter row positions[b]. Chain steps run batched, so each weight is
        read once per draft position for the whole batch; `runner` runs the forwards (eager, static
        or captured), a greedy batch's whole chain in one forward where the runner has it. grammar
        (engine/grammar.StepMasks, the seed's grammar_bitmask): each position's logits masked by the
        state after the drafts before it, so the chain runs step by step (the next mask needs the
        last draft on the host)."""
        for pos, st in zip(positions, states):
            self._check_aligned(pos, st)
        caches = [st.cache for st in states]
        if hasattr(self.layer, "start_propose"):  # a layer that keeps step 0's selections for the chain
            self.layer.start_propose()
        fused = runner.fused_chain(tokens, hiddens, caches, num_drafts) if num_drafts and grammar is None else None
        if fused is not None:
            self._mark_fed(states, tokens)
            return self._record(states, Drafts(fused, [num_drafts] * len(states)))
        logits, carried = runner.catchup(self, tokens, hiddens, caches)
        self._mark_fed(states, tokens)
        b = len(states)
        gens = [st.gen or self.gen for st in states]  # each sequence's drafts from its request's stream
        drafts, probs, confs = [], [], []
        active = [True] * b
        counts = [0] * b
        for i_step in range(num_drafts):
            if grammar is not None:
                logits = grammar.draft(i_step, logits, drafts[-1] if i_step else None, self.draft_head)
            d, q = choose(logits, self.sampling, gens)
            if self.draft_head is not None:
                d = self.draft_head.to_full(d)
                q = None if q is None else self.draft_head.probs_to_full(q, self.head.weight.shape[0])
            drafts.append(d)
            probs.append(q)
            if self.tau is not None:
                top1 = (q if q is not None else logits.float().softmax(-1)).max(-1).values
                confs.append(top1)
                low = (top1 < self.tau).tolist()  # host sync: only with --draft-conf-tau
                for i in range(b):
                    if active[i] and i_step > 0 and low[i]:
                        active[i] = False
            for i in range(b):
                counts[i] += active[i]
            if i_step == num_drafts - 1 or not any(active):
                break
            with self.chained():
                logits, carried = runner.chain_step(self, d, carried, caches)
        tokens = torch.stack(drafts, 1) if drafts else torch.empty(b, 0, dtype=torch.long, device=logits.device)
        probs = torch.stack(probs, 1) if drafts and probs[0] is not None else None
        confs = [float(min(c[i] for c in confs[: max(counts[i], 1)])) for i in range(b)] if confs else None
        return self._record(states, Drafts(tokens, counts, probs, confs))

    def chained(self):
        """Marks a chained draft step for a layer that treats those apart (GLM-5-Next's
        index_share_for_mtp_iteration reuses step 0's top-k in them); a no-op for the others."""
        return self.layer.chained() if hasattr(self.layer, "chained") else nullcontext()

    @staticmethod
    def _record(states: list[ProposerState], drafts: Drafts) -> Drafts:
        for i, st in enumerate(states):
            st.last_drafts, st.row = drafts, i
        return drafts

    def greedy_fusable(self) -> bool:
        """Whether a batch's whole draft chain can be one forward (greedy, no confidence stop)."""
        return self.sampling.greedy and self.tau is None

    def after_verify(self, num_accepted: int, state: ProposerState) -> None:
        """Drop the chain's speculative rows. Accepted drafts get real rows (built from the target's
        hiddens) at the next catch-up, so only rows from target hiddens survive."""
        proposed = state.last_drafts.counts[state.row] if state.last_drafts is not None else None
        if proposed is not None and num_accepted > proposed:
            raise ValueError(f"accepted {num_accepted} of {proposed} drafts")
        state.cache.truncate(state.real_rows)

    # ---- carry across turns -----------------------------------------------------------------
    def take_drafter_kv(self, state: ProposerState) -> DrafterKV:
        """Move the real rows out of a finished state; the state no longer owns them."""
        cache = state.cache
        cache.truncate(state.real_rows)
        kv = DrafterKV(cache, state.real_rows, _host_tokens(state.row_tokens))
        state.cache = None
        return kv

    def install_drafter_kv(self, kv: DrafterKV, state: ProposerState) -> None:
        """Put a carried cache into a fresh state (whose own empty cache is given back)."""
        if state.cache is not None and state.cache.length:
            raise ValueError("install_drafter_kv needs a fresh state")
        if state.cache is not None:
            state.cache.release()
        try:
            kv.cache.reserve(state.budget_tokens)
        except Exception:
            kv.cache.release()
            state.cache = None
            raise
        state.cache = kv.cache
        state.real_rows = kv.rows
        state.row_tokens = [torch.tensor(kv.tokens, dtype=torch.long, device=self.embed.weight.device)]
        kv.cache = None

    def free_drafter_kv(self, kv: DrafterKV) -> None:
        if kv.cache is not None:
            kv.cache.release()
            kv.cache = None


def _host_tokens(chunks: list) -> list[int]:
    chunks = [c if isinstance(c, torch.Tensor) else c[0][c[1]] for c in chunks]  # (BatchRows, j): its view now
    return torch.cat(chunks).tolist() if chunks else []
