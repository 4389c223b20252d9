"""The GLM-5-Next MTP layer (`layers.{num_hidden_layers}`) and its greedy draft chain
(REFERENCE-glm5next section 9; transformers has no MTP layer, the math follows the public engines).

Row i of the MTP layer's cache is built from (token t[i+1], target hidden h[i]):

    x = eh_proj([enorm(E t[i+1]) ; hnorm(h[i])])      (embedding zeroed at row 0)
    x = x + MLA_with_own_pooled_indexer(input_layernorm(x))
    x = x + MoE(post_attention_layernorm(x))          (plain residual: no mHC streams)
    g = shared_head.norm(x);   draft logits = target lm_head(g)

h is the target's post-norm hidden (mean of the streams, then model.norm), never the stream state.
A chain feeds each draft back with g in place of h. Only rows whose (token, hidden) pair is real are
committed to the cache; chain rows are rolled back (truncate + restore the indexer tail).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from glm5mtp_cli.models.glm5.layers import RMSNorm
from glm5mtp_cli.models.glm5_next.attention import MlaLayer
from glm5mtp_cli.models.glm5_next.config import NextConfig
from glm5mtp_cli.models.glm5_next.decoder import make_mlp
from glm5mtp_cli.models.glm5_next.state import IndexedSlot


class _SharedHead(nn.Module):
    def __init__(self, cfg: NextConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


@dataclass
class DraftChain:
    tokens: torch.Tensor   # [num_drafts] greedy drafts
    logits: torch.Tensor   # [num_drafts, V] the logits each draft came from
    hidden: torch.Tensor   # [num_drafts, D] post-norm g of each step


class Glm5NextMtpLayer(nn.Module):
    """state_dict keys = checkpoint names after `model.language_model.layers.{N}.`."""

    def __init__(self, cfg: NextConfig):
        super().__init__()
        d = cfg.hidden_size
        self.cfg = cfg
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.enorm = RMSNorm(d, eps=cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, eps=cfg.rms_norm_eps)
        self.shared_head = _SharedHead(cfg)
        self.input_layernorm = RMSNorm(d, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, eps=cfg.rms_norm_eps)
        self.self_attn = MlaLayer(cfg)
        self.mlp = make_mlp(cfg, True)

    def new_state(self, capacity: int) -> IndexedSlot:
        p = self.eh_proj.weight
        return IndexedSlot.alloc(self.cfg, capacity, p.dtype, p.device)

    def forward_rows(self, tokens: torch.Tensor, hiddens: torch.Tensor, slot: IndexedSlot, embed: nn.Embedding,
                     head: nn.Linear, reuse_selection: torch.Tensor | None = None):
        """Rows slot.length.. from tokens [T] (t[i+1]) and hiddens [T, D] (h[i]); slot is read only.
        Returns (logits [T, V], g [T, D], pending)."""
        e = embed(tokens)
        pos = slot.length + torch.arange(tokens.shape[0], device=tokens.device)
        e = e.masked_fill((pos == 0)[:, None], 0.0)  # as the public engines: no embedding at row 0
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hiddens.to(e.dtype))], dim=-1))
        y, pending = self.self_attn(self.input_layernorm(x), slot.past(), reuse_selection)
        x = x + y
        x = x + self.mlp(self.post_attention_layernorm(x))
        g = self.shared_head.norm(x)
        return head(g), g, pending

    # ---- the drafter's life cycle --------------------------------------------------------------
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

