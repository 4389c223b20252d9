"""Glm5MtpHead: GLM-5's MTP layer as a DraftProposer (REFERENCE.md section 4).

A propose call first appends the sequence's pending real rows (tokens accepted since the last call,
each paired with the target hidden of the position before it) in one forward; the last of those
rows yields draft 1. Each further draft feeds the previous draft with the drafter's own hidden:
post-shared_head.norm `g` for GLM (carrying the pre-norm `y` collapses acceptance after the first
position), pre-norm when the config asks for DeepSeek's chaining.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from glm5mtp_cli.engine.cache import CachePools
from glm5mtp_cli.engine.draft_vocab import SubsetHead
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.engine.graphs import load_rows
from glm5mtp_cli.models.glm5 import Glm5MtpLayer
from glm5mtp_cli.engine.proposer import CatchupMisaligned, DraftChain, DrafterKV, ProposerState
from glm5mtp_cli.engine.sampling import SamplingParams, choose


class Glm5MtpHead:
    def __init__(self, layer: Glm5MtpLayer, embed: nn.Embedding, head: nn.Linear, pools: CachePools,
                 max_seq_len: int, sampling: SamplingParams = SamplingParams(),
                 draft_conf_tau: float | None = None, generator: torch.Generator | None = None,
                 batch_max: int = 256, draft_ids: torch.Tensor | None = None):
        self.layer = layer
        self.embed = embed
        self.head = head
        # --draft-vocab: chain steps score only these tokens (a catch-up row's logits are unused
        # except the last, which drafts too, so every drafting forward uses the subset head)
        self.draft_head = SubsetHead(head, draft_ids) if draft_ids is not None else None
        self.pools = pools
        self.max_seq_len = max_seq_len
        self.sampling = sampling
        self.tau = draft_conf_tau
        self.gen = generator
        self.batch_max = batch_max
        self.carry_normed = layer.cfg.mtp_carry_normed_hidden

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
        state.freed = True

    def drafter_rows(self, state: ProposerState) -> int:
        return state.cache.length

    # ---- filling ----------------------------------------------------------------------------
    def prefill_drafter(self, prompt_tokens: torch.Tensor, hiddens: torch.Tensor, state: ProposerState) -> None:
        """Rows 0..P-2 of the prompt: (t[i+1], h[i])."""
        if prompt_tokens.shape[0] >= 2:
            self.catchup_drafter(prompt_tokens[1:], hiddens[:-1], 0, state)

    def catchup_drafter(self, tokens: torch.Tensor, hiddens: torch.Tensor, row_base: int,
                        state: ProposerState) -> None:
        """Append real rows row_base.. for accepted tokens; refuse a feed that would leave a gap."""
        self._check_aligned(row_base, state)
        if tokens.shape[0]:
            self.layer(tokens[None], hiddens[None], [state.cache], self.embed, self.head, rows="last")
            self._mark_real(state, tokens)

    def _check_aligned(self, row_base: int, state: ProposerState) -> None:
        if state.cache is None:
            raise CatchupMisaligned("drafter state was freed or its KV taken")
        if row_base != state.cache.length or state.real_rows != state.cache.length:
            raise CatchupMisaligned(
                f"catch-up starts at row {row_base}, but the drafter holds {state.cache.length} rows "
                f"({state.real_rows} real): call after_verify first and feed from drafter_rows()")

    @staticmethod
    def _mark_real(state: ProposerState, tokens: torch.Tensor) -> None:
        state.real_rows = state.cache.length
        state.row_tokens.append(tokens)  # kept on the device: reading them back would sync every step

    # ---- drafting ---------------------------------------------------------------------------
    def propose(self, last_token, hidden, position: int, num_drafts: int, state: ProposerState) -> DraftChain:
        tokens = torch.as_tensor(last_token, device=hidden.device).reshape(-1)
        return self.propose_batch([tokens], [hidden.reshape(tokens.shape[0], -1)], [position], num_drafts, [state])[0]

    def propose_batch_max(self) -> int:
        return self.batch_max

    def propose_batch(self, tokens: list[torch.Tensor], hiddens: list[torch.Tensor], positions: list[int],
                      num_drafts: int, states: list[ProposerState], graphs=None, slots=None) -> list[DraftChain]:
        """Drafts for many sequences. tokens[b]/hiddens[b]: the pending real rows of sequence b
        (at least one: the newest accepted token and the target hidden before it), starting at
        drafter row positions[b]. Chain steps run batched, so each weight is read once per draft
        position for the whole batch. With `graphs` (a graphs.BatchGraphs) the forwards replay its
        static catch-up and chain forwards; `slots` = (slot of each sequence, the same on the device)."""
        if len(states) > self.batch_max:
            raise ValueError(f"propose_batch takes at most {self.batch_max} sequences")
        b = len(states)
        for pos, st in zip(positions, states):
            self._check_aligned(pos, st)
        if graphs is not None and graphs.draft is not None:
            return self._propose_fused(graphs.draft, slots, tokens, hiddens, num_drafts, states)
        if graphs is None:
            logits_t, hidden_t = self._catchup_eager(tokens, hiddens, states)
            caches = [st.cache for st in states]

            def step(d, h):
                out = self.layer(d[:, None], h[:, None], caches, self.embed, self.draft_head or self.head, rows="last")
                return out.logits[:, -1], self._carried(out)[:, -1]
        else:
            logits_t, hidden_t = self._catchup_static(graphs.catchup, slots, tokens, hiddens, states)

            def step(d, h):
                return self._chain_static(graphs.chain, slots, d, h, states)
        drafts, probs, confs = [], [], []
        active = [True] * b
        counts = [0] * b
        for i_step in range(num_drafts):
            d, q = choose(logits_t, self.sampling, self.gen)
            if self.draft_head is not None:
                d = self.draft_head.to_full(d)
                q = None if q is None else self.draft_head.probs_to_full(q, self.head.weight.shape[0])
            drafts.append(d)
            probs.append(q)
            if self.tau is not None:
                top1 = (q if q is not None else logits_t.float().softmax(-1)).max(-1).values
                confs.append(top1)
                low = (top1 < self.tau).tolist()  # host sync: only with --draft-conf-tau
                for i in range(b):
                    if active[i] and i_step > 0 and low[i]:
                        active[i] = False
            for i in range(b):
                counts[i] += active[i]
            if i_step == num_drafts - 1 or not any(active):
                break
            logits_t, hidden_t = step(d, hidden_t)
        chains = []
        dev = logits_t.device
        for i in range(b):
            toks = torch.stack([d[i] for d in drafts]) if drafts else torch.empty(0, dtype=torch.long, device=dev)
            pr = torch.stack([q[i] for q in probs]) if drafts and probs[0] is not None else None
            conf = float(min(c[i] for c in confs[: max(counts[i], 1)])) if confs else None
            chain = DraftChain(toks, pr, counts[i] if num_drafts else 0, conf)
            states[i].last_chain = chain
            chains.append(chain)
        return chains

    def _carried(self, out) -> torch.Tensor:
        return out.hidden if self.carry_normed else out.prenorm

    def _catchup_eager(self, tokens, hiddens, states):
        """Catch-up forwards, sequences grouped by how many rows they append; -> the logits and
        carried hidden at each sequence's last real row."""
        logits = [None] * len(states)
        carried = [None] * len(states)
        groups: dict[int, list[int]] = defaultdict(list)
        for i, tok in enumerate(tokens):
            groups[tok.shape[0]].append(i)
        for k, members in groups.items():
            out = self.layer(torch.stack([tokens[i] for i in members]), torch.stack([hiddens[i] for i in members]),
                             [states[i].cache for i in members], self.embed, self.draft_head or self.head,
                             rows="last")
            for j, i in enumerate(members):
                logits[i] = out.logits[j, -1]
                carried[i] = self._carried(out)[j, -1]
                self._mark_real(states[i], tokens[i])
        return torch.stack(logits), torch.stack(carried)

    def _catchup_static(self, f, slots, tokens, hiddens, states):
        """One padded catch-up forward over every slot (graphs.StaticForward, T = gamma + 1)."""
        slot_list, slots_dev = slots
        load_rows(f.ids, slots_dev, slot_list, tokens)
        load_rows(f.hidden, slots_dev, slot_list, hiddens)
        starts, rows = [0] * f.b, [0] * f.b
        for slot, st, tok in zip(slot_list, states, tokens):
            if st.cache.length + tok.shape[0] > st.cache.capacity:
                raise RuntimeError("drafter catch-up past the reservation its graph was built for")
            starts[slot], rows[slot] = st.cache.length, tok.shape[0] - 1
        f.set_starts(starts)
        f.set_rows(rows)
        out = f.run()
        for st, tok in zip(states, tokens):
            st.cache.length += tok.shape[0]
            self._mark_real(st, tok)
        return _take(out.logits, slots_dev)[:, 0], _take(self._carried(out), slots_dev)[:, 0]

    def _propose_fused(self, f, slots, tokens, hiddens, num_drafts, states) -> list[DraftChain]:
        """Greedy: the whole chain is one static forward (graphs.draft_chain_greedy)."""
        if num_drafts != f.t - 1:
            raise ValueError(f"the fused draft forward was built for {f.t - 1} drafts, asked for {num_drafts}")
        slot_list, slots_dev = slots
        load_rows(f.ids, slots_dev, slot_list, tokens)
        load_rows(f.hidden, slots_dev, slot_list, hiddens)
        starts, rows = [0] * f.b, [0] * f.b
        for slot, st, tok in zip(slot_list, states, tokens):
            if st.cache.length + tok.shape[0] + num_drafts - 1 > st.cache.capacity:
                raise RuntimeError("draft chain past the reservation its graph was built for")
            starts[slot], rows[slot] = st.cache.length, tok.shape[0] - 1
        f.set_starts(starts)
        f.set_rows(rows)
        drafts = _take(f.run(), slots_dev)  # [A, gamma]
        chains = []
        for i, (st, tok) in enumerate(zip(states, tokens)):
            st.cache.length += tok.shape[0]
            self._mark_real(st, tok)
            st.cache.length += num_drafts - 1  # the chain's speculative rows
            st.last_chain = DraftChain(drafts[i], None, num_drafts, None)
            chains.append(st.last_chain)
        return chains

    def _chain_static(self, f, slots, d, h, states):
        slot_list, slots_dev = slots
        load_rows(f.ids, slots_dev, slot_list, d[:, None])
        load_rows(f.hidden, slots_dev, slot_list, h[:, None])
        starts = [0] * f.b
        for slot, st in zip(slot_list, states):
            starts[slot] = st.cache.length
            st.cache.length += 1
        f.set_starts(starts)
        out = f.run()
        return _take(out.logits, slots_dev)[:, -1], _take(self._carried(out), slots_dev)[:, -1]

    def after_verify(self, num_accepted: int, state: ProposerState) -> None:
        """Drop the chain's speculative rows. Accepted drafts get real rows (built from the target's
        hiddens) at the next catch-up, so only rows from target hiddens survive."""
        if state.last_chain is not None and num_accepted > state.last_chain.num_drafts:
            raise ValueError(f"accepted {num_accepted} of {state.last_chain.num_drafts} drafts")
        state.cache.truncate(state.real_rows)

    def last_confidence(self, state: ProposerState) -> float | None:
        return state.last_chain.confidence if state.last_chain is not None else None

    def needs_comm(self) -> bool:
        """True when the layer is sharded over ranks: every rank must then run each propose call in
        lockstep (same inputs, same generator seed), or the collectives inside the layer hang or,
        skipped, leave partial sums."""
        comm = getattr(self.layer, "comm", None)
        return comm is not None and comm.world > 1

    # ---- carry across turns -----------------------------------------------------------------
    def take_drafter_kv(self, state: ProposerState) -> DrafterKV:
        """Move the real rows out of a finished state; the state no longer owns them."""
        cache = state.cache
        cache.truncate(state.real_rows)
        kv = DrafterKV(cache, state.real_rows, _host_tokens(state.row_tokens))
        state.cache = None
        state.freed = True
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


def _take(t: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The active slots' rows of a static output (a copy, so the next replay cannot change them)."""
    return t.index_select(0, slots)


def _host_tokens(chunks: list) -> list[int]:
    return torch.cat(chunks).tolist() if chunks else []
