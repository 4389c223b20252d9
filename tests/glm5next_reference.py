"""GLM-5-Next one sequence at a time: the reference the engine's batched forwards over the pools
(models/glm5_next/pooled.py, paged.py) and the training forward are tested against. Test-only: it
runs the product's modules (the blocks, KdaLayer.forward, MlaLayer.forward, their pending records)
over plain per-sequence storage, and the engine never calls it.

    target = Target(model)                                     # a Glm5NextForCausalLM
    state = target.new_state(capacity)
    logits, hidden = target.prefill(tokens, state)             # chunks, each committed whole
    logits, hidden = target.decode(token, state)
    logits, hidden, pending = target.verify(tokens, state)     # gamma+1 rows, state untouched
    target.commit(state, pending, keep)                        # keep the first `keep` rows

    mtp = Mtp(layer)                                           # a Glm5NextMtpLayer
    slot = mtp.new_state(capacity)
    mtp.prefill(prompt, hiddens, slot, embed, head)
    chain = mtp.propose(last_token, hidden, slot, num_drafts, embed, head)

`hidden` is the post-norm row the MTP layer reads (never the stream state).

Per-sequence storage (REFERENCE-glm5next section 8, cache summary):
- `kda_state`   per KDA layer, fixed: the recurrent S [H, d, d], always fp32;
- `kda_conv`    per KDA layer, fixed: the last K-1 pre-conv q|k|v rows [K-1, 3 H d];
- `mla_latent`  per indexed layer (and the MTP layer), grows: one kv_lora_rank row per token;
- `index_pool`  per indexed layer, grows: one pooled key (index_head_dim) per complete pool of P
                tokens;
- `index_tail`  per indexed layer, fixed: the raw (key, gate) rows of the incomplete pool, P-1 rows.
Plain contiguous tensors per sequence with capacity reserved up front; the layers read views and
return pending rows, and `apply` writes what a commit keeps.

Also `boundary_ties`: the queries where the pool top-k is decided by a tie (tests check their inputs
have none, as full and cached forwards may break ties differently).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from glm5mtp_cli.models.glm5_next.attention import MlaCommit, MlaPast, MlaPending
from glm5mtp_cli.models.glm5_next.config import NextConfig
from glm5mtp_cli.models.glm5_next.decoder import DEFAULT_ROLLBACK, Glm5NextForCausalLM, NextBlock
from glm5mtp_cli.models.glm5_next.kda import CHUNK, KdaPending
from glm5mtp_cli.models.glm5_next.mhc import contract_streams, expand_streams
from glm5mtp_cli.models.glm5_next.mtp import Glm5NextMtpLayer


# ---- per-sequence storage -------------------------------------------------------------------------

@dataclass
class KdaSlot:
    state: torch.Tensor    # [H, d, d] fp32
    window: torch.Tensor   # [K-1, 3C]

    @classmethod
    def alloc(cls, cfg: NextConfig, dtype, device) -> "KdaSlot":
        h, d = cfg.linear_num_heads, cfg.linear_head_dim
        return cls(torch.zeros(h, d, d, dtype=torch.float32, device=device),
                   torch.zeros(cfg.linear_conv_kernel_dim - 1, 3 * cfg.linear_dim, dtype=dtype, device=device))

    def apply(self, state: torch.Tensor, window: torch.Tensor) -> None:
        self.state.copy_(state)
        self.window.copy_(window)


@dataclass
class IndexedSlot:
    """One indexed layer's rows: latent [cap, R], pooled [cap // P, di], tail [P-1, 2 di]."""

    latent: torch.Tensor
    pooled: torch.Tensor
    tail: torch.Tensor
    pool: int
    length: int = 0

    @classmethod
    def alloc(cls, cfg: NextConfig, capacity: int, dtype, device) -> "IndexedSlot":
        P, di = cfg.index_kpool, cfg.index_head_dim
        return cls(torch.zeros(capacity, cfg.kv_lora_rank, dtype=dtype, device=device),
                   torch.zeros(capacity // P, di, dtype=dtype, device=device),
                   torch.zeros(max(P - 1, 0), 2 * di, dtype=dtype, device=device), P)

    @property
    def capacity(self) -> int:
        return self.latent.shape[0]

    def past(self) -> MlaPast:
        n, P = self.length, self.pool
        return MlaPast(self.latent[:n], self.pooled[: n // P], self.tail[: n % P])

    def apply(self, c: MlaCommit) -> None:
        """Write an MlaCommit: latent rows, completed pools, the new tail; length grows to match."""
        n = c.start + c.latent.shape[0]
        if n > self.capacity:
            raise ValueError(f"sequence state holds {self.capacity} rows; {n} needed")
        self.latent[c.start:n].copy_(c.latent)
        self.pooled[c.pool_start:c.pool_start + c.pooled.shape[0]].copy_(c.pooled)
        self.tail[: c.tail.shape[0]].copy_(c.tail)
        self.length = n


@dataclass
class SequenceState:
    """The target's per-sequence state: one slot per KDA layer and per indexed layer."""

    kda: dict[int, KdaSlot] = field(default_factory=dict)
    indexed: dict[int, IndexedSlot] = field(default_factory=dict)
    length: int = 0

    @classmethod
    def alloc(cls, cfg: NextConfig, capacity: int, dtype=torch.float32, device="cpu") -> "SequenceState":
        st = cls()
        for i in cfg.kda_layers:
            st.kda[i] = KdaSlot.alloc(cfg, dtype, device)
        for i in cfg.indexed_layers:
            st.indexed[i] = IndexedSlot.alloc(cfg, capacity, dtype, device)
        return st


# ---- the target -----------------------------------------------------------------------------------

@dataclass
class StepPending:
    """Pending rows of one forward over T rows starting at position `start`."""

    start: int
    rows: int
    layers: dict[int, KdaPending | MlaPending]


def block_forward(block: NextBlock, streams: torch.Tensor, past, kda_mode: str = "final", chunk: int = CHUNK):
    """One trunk layer over one sequence: streams [T, n, D]; past: (S, window) for a KDA layer, an
    MlaPast otherwise. Returns (streams, pending)."""
    if block.kda:
        return block.run(streams, lambda a: block.self_attn(a, past[0], past[1], mode=kda_mode, chunk=chunk))
    return block.run(streams, lambda a: block.self_attn(a, past))


class Target:
    """A Glm5NextForCausalLM run one sequence per call over a SequenceState."""

    def __init__(self, model: Glm5NextForCausalLM):
        self.model = model
        self.cfg = model.cfg

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.embed_tokens

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.lm_head

    def new_state(self, capacity: int) -> SequenceState:
        p = self.model.lm_head.weight
        return SequenceState.alloc(self.cfg, capacity, dtype=p.dtype, device=p.device)

    def forward_rows(self, tokens: torch.Tensor, state: SequenceState, kda_mode: str = "final",
                     chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor, StepPending]:
        """Rows tokens [T] at positions state.length.. ; state is read, not written.
        Returns (logits [T, V], hidden [T, D] post-norm, pending)."""
        m = self.model
        streams = expand_streams(m.embed_tokens(tokens), self.cfg.hc_mult)
        pending: dict[int, KdaPending | MlaPending] = {}
        for i, block in enumerate(m.layers):
            if block.kda:
                slot = state.kda[i]
                past = (slot.state, slot.window)
            else:
                past = state.indexed[i].past()
            streams, pending[i] = block_forward(block, streams, past, kda_mode, chunk)
        hidden = m.norm(contract_streams(streams))
        return m.lm_head(hidden), hidden, StepPending(state.length, tokens.shape[0], pending)

    def commit(self, state: SequenceState, pending: StepPending, keep: int) -> None:
        """Keep the first `keep` rows of `pending` (0..rows; a verify that accepted a drafts keeps
        a+1): afterwards every component equals what a fresh prefill of the kept prefix builds."""
        if pending.start != state.length:
            raise ValueError(f"pending rows start at {pending.start}, state holds {state.length}")
        if not 0 <= keep <= pending.rows:
            raise ValueError(f"keep must be in 0..{pending.rows}, got {keep}")
        k = self.cfg.linear_conv_kernel_dim
        for i, p in pending.layers.items():
            if isinstance(p, KdaPending):
                state.kda[i].apply(*p.commit(keep, k))
            else:
                state.indexed[i].apply(p.commit(keep))
        state.length += keep

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, state: SequenceState, chunk_tokens: int | None = None,
                kda_chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
        """Append tokens in pieces of chunk_tokens (all at once by default), each committed whole."""
        step = chunk_tokens or max(tokens.shape[0], 1)
        logits, hidden = [], []
        for s in range(0, tokens.shape[0], step):
            lg, h, pend = self.forward_rows(tokens[s:s + step], state, "final", kda_chunk)
            self.commit(state, pend, pend.rows)
            logits.append(lg)
            hidden.append(h)
        return torch.cat(logits), torch.cat(hidden)

    @torch.no_grad()
    def decode(self, token: torch.Tensor, state: SequenceState) -> tuple[torch.Tensor, torch.Tensor]:
        return self.prefill(token.reshape(1), state)

    @torch.no_grad()
    def verify(self, tokens: torch.Tensor, state: SequenceState, rollback: str = DEFAULT_ROLLBACK):
        """gamma+1 rows in one forward; the state is untouched until commit(state, pending, keep).
        rollback: 'states' (per-position KDA states) or 'replay' (checkpoint + replay)."""
        if rollback not in ("states", "replay"):
            raise ValueError(f"rollback must be 'states' or 'replay', got {rollback!r}")
        return self.forward_rows(tokens, state, rollback)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole-prompt logits and hiddens, no state kept (a scratch state of exactly T rows)."""
        return self.prefill(tokens, self.new_state(tokens.shape[0]))

    __call__ = forward


# ---- the MTP layer --------------------------------------------------------------------------------

@dataclass
class DraftChain:
    tokens: torch.Tensor   # [num_drafts] greedy drafts
    logits: torch.Tensor   # [num_drafts, V] the logits each draft came from
    hidden: torch.Tensor   # [num_drafts, D] post-norm g of each step


class Mtp:
    """A Glm5NextMtpLayer run one sequence per call over an IndexedSlot (mtp.py's docstring has the
    math). Only rows whose (token, hidden) pair is real stay committed; a chain's rows are rolled
    back (length + the indexer tail)."""

    def __init__(self, layer: Glm5NextMtpLayer):
        self.layer = layer
        self.cfg = layer.cfg

    def new_state(self, capacity: int) -> IndexedSlot:
        p = self.layer.eh_proj.weight
        return IndexedSlot.alloc(self.cfg, capacity, p.dtype, p.device)

    def forward_rows(self, tokens: torch.Tensor, hiddens: torch.Tensor, slot: IndexedSlot, embed: nn.Embedding,
                     head: nn.Linear, reuse_selection: torch.Tensor | None = None):
        """Rows slot.length.. from tokens [T] (t[i+1]) and hiddens [T, D] (h[i]); slot is read only.
        Returns (logits [T, V], g [T, D], pending)."""
        m = self.layer
        e = embed(tokens)
        pos = slot.length + torch.arange(tokens.shape[0], device=tokens.device)
        e = e.masked_fill((pos == 0)[:, None], 0.0)  # as the public engines: no embedding at row 0
        x = m.eh_proj(torch.cat([m.enorm(e), m.hnorm(hiddens.to(e.dtype))], dim=-1))
        y, pending = m.self_attn(m.input_layernorm(x), slot.past(), reuse_selection)
        x = x + y
        x = x + m.mlp(m.post_attention_layernorm(x))
        g = m.shared_head.norm(x)
        return head(g), g, pending

    @torch.no_grad()
    def catchup(self, tokens: torch.Tensor, hiddens: torch.Tensor, slot: IndexedSlot, embed, head):
        """Append real rows (t[i+1], h[i]); returns their (logits, g)."""
        logits, g, pending = self.forward_rows(tokens, hiddens, slot, embed, head)
        slot.apply(pending.commit(tokens.shape[0]))
        return logits, g

    @torch.no_grad()
    def prefill(self, prompt: torch.Tensor, hiddens: torch.Tensor, slot: IndexedSlot, embed, head) -> None:
        """Rows 0..P-2 of a prompt of P tokens with the target's hiddens [P, D]."""
        if slot.length != 0:
            raise ValueError("prefill expects an empty MTP state")
        if prompt.shape[0] >= 2:
            self.catchup(prompt[1:], hiddens[:-1], slot, embed, head)

    @torch.no_grad()
    def propose(self, last_token: torch.Tensor, hidden: torch.Tensor, slot: IndexedSlot, num_drafts: int,
                embed, head, share_topk: bool | None = None) -> DraftChain:
        """Greedy chain of num_drafts drafts. Row slot.length = (last_token, hidden) is real (the newest
        accepted token and the verified target hidden before it) and stays committed; the chain rows
        after it are rolled back before returning.

        share_topk (default cfg.index_share_for_mtp_iteration): chain steps reuse step 0's own pool
        selection instead of scoring again."""
        share = self.cfg.index_share_for_mtp_iteration if share_topk is None else share_topk
        logits, g, pending = self.forward_rows(last_token.reshape(1), hidden.reshape(1, -1), slot, embed, head)
        slot.apply(pending.commit(1))
        sel0 = pending.selected if share else None  # step 0's OWN top-k, never the target's
        tokens, outs, gs = [logits[-1].argmax()], [logits[-1]], [g[-1]]
        mark = self.snapshot(slot)
        try:
            for _ in range(num_drafts - 1):
                lg, g, pending = self.forward_rows(tokens[-1].reshape(1), gs[-1].reshape(1, -1), slot, embed, head, sel0)
                slot.apply(pending.commit(1))
                tokens.append(lg[-1].argmax())
                outs.append(lg[-1])
                gs.append(g[-1])
        finally:
            self.restore(slot, mark)
        return DraftChain(torch.stack(tokens), torch.stack(outs), torch.stack(gs))

    @staticmethod
    def snapshot(slot: IndexedSlot) -> tuple[int, torch.Tensor]:
        """What a rollback to the current length needs: the length and the tail rows (the only
        component later rows overwrite in place)."""
        return slot.length, slot.tail.clone()

    @staticmethod
    def restore(slot: IndexedSlot, mark: tuple[int, torch.Tensor]) -> None:
        slot.length = mark[0]
        slot.tail.copy_(mark[1])


# ---- top-k ties -----------------------------------------------------------------------------------

def boundary_ties(scores: torch.Tensor, visible: torch.Tensor, n_select: int, tol: float = 0.0) -> torch.Tensor:
    """Queries whose k-th and (k+1)-th best visible pool scores tie (within tol): there the selection
    depends on how topk breaks ties, so different shapes (full vs cached) may pick different pools."""
    out = torch.zeros(scores.shape[0], dtype=torch.bool, device=scores.device)
    for i in range(scores.shape[0]):
        n = int(visible[i])
        if n <= n_select:
            continue
        v = scores[i, :n].sort(descending=True).values
        out[i] = (v[n_select - 1] - v[n_select]).abs() <= tol
    return out
