"""MtpHead: a model family's MTP layer as a DraftProposer (REFERENCE.md section 4; GLM-5-Next's
section 9 is the same skeleton). The layer is the family's: it appends drafter rows over the
drafter's SequenceCaches (`layer(...)`), runs the same as a function of a context
(`forward_batch`, `context`), and returns logits, the post-norm hidden and the pre-norm one.

The engine drives a propose (engine/drafting.py) through the runner, which runs this head's
forwards: a catch-up of the pending real rows, whose last row yields draft 1, then chained rows.
Each further draft feeds the previous draft with the drafter's own hidden: post-shared_head.norm
`g` for GLM (carrying the pre-norm `y` collapses acceptance after the first position), pre-norm
when the config asks for DeepSeek's chaining.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from glm5mtp_cli.core.families import family_of
from glm5mtp_cli.engine.cache import CachePools
from glm5mtp_cli.engine.config import EngineConfig
from glm5mtp_cli.engine.draft_vocab import SubsetHead
from glm5mtp_cli.engine.proposer import DrafterKV, ProposerState, check_aligned
from glm5mtp_cli.engine.sampling import choose
from glm5mtp_cli.errors import UserError


class MtpHead:
    def __init__(self, layer: nn.Module, embed: nn.Embedding, head: nn.Linear, pools: CachePools,
                 config: EngineConfig, draft_ids: torch.Tensor | None = None, carry_normed: bool = True):
        """config: the engine's (sampling, max_seq_len: the rows a state may reserve);
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
        # the proposer's own stream serves only states without one (tests' direct proposes): the
        # engine's requests each bring theirs (sampling.request_stream)
        self.gen = torch.Generator(device=embed.weight.device).manual_seed(config.sampling.seed)
        self.carry_normed = carry_normed

    # ---- state ------------------------------------------------------------------------------
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
        check_aligned(row_base, state)
        if tokens.shape[0]:
            self.layer(tokens[None], hiddens[None], [state.cache], self.embed, self.head, rows="last")
            state.add_real(tokens[None], 0, tokens.shape[0])

    def append_rows(self, ids: torch.Tensor, hiddens: torch.Tensor, caches: list, real: list[int]) -> None:
        """One eager shared forward of drafter rows ids [m, t] with hiddens [m, t, H]; row j's rows
        past real[j] are padding, cut back (the next append overwrites them)."""
        starts = [c.length for c in caches]
        self.layer(ids, hiddens, caches, self.embed, self.head, rows="last")
        for c, start, k in zip(caches, starts, real):
            if k < ids.shape[1]:
                c.truncate(start + k)

    # ---- the forwards, as functions of device tensors (eager, static and captured alike) -------
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

    # ---- drafting (engine/drafting.py drives it) ---------------------------------------------
    def start_propose(self) -> None:
        """A layer that keeps step 0's selections for the chain (PooledMtp) drops the last propose's."""
        if hasattr(self.layer, "start_propose"):
            self.layer.start_propose()

    def choose(self, logits: torch.Tensor, states: list[ProposerState]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft ids [A] over the full vocabulary from drafter logits [A, V'] (V': --draft-vocab's
        subset), and (sampling) the full-vocabulary distributions they were drawn from, each
        sequence's from its request's stream."""
        d, q = choose(logits, self.sampling, [st.gen or self.gen for st in states])
        if self.draft_head is not None:
            d = self.draft_head.to_full(d)
            q = None if q is None else self.draft_head.probs_to_full(q, self.head.weight.shape[0])
        return d, q

    def chained(self):
        """Marks a chained draft step for a layer that treats those apart (GLM-5-Next's
        index_share_for_mtp_iteration reuses step 0's top-k in them); a no-op for the others."""
        return self.layer.chained() if hasattr(self.layer, "chained") else nullcontext()

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
        kv = DrafterKV(cache, state.real_rows, state.host_tokens())
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
        state.row_tokens = [(torch.tensor([kv.tokens], dtype=torch.long, device=self.embed.weight.device), 0, kv.rows)]
        kv.cache = None

    def free_drafter_kv(self, kv: DrafterKV) -> None:
        if kv.cache is not None:
            kv.cache.release()
            kv.cache = None



def mtp_proposer(cfg, target, mtp: nn.Module, pools: CachePools, config: EngineConfig,
                 draft_ids: torch.Tensor | None = None) -> MtpHead:
    """The MTP head of cfg's family: its MTP layer over the target's embedding and head."""
    parts = family_of(cfg).mtp_parts(target, mtp)
    return MtpHead(parts.layer, parts.embed, parts.head, pools, config, draft_ids, carry_normed=parts.carry_normed)
