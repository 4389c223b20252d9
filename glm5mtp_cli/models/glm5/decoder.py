"""The GLM-5 target (Glm5ForCausalLM) and its MTP layer (Glm5MtpLayer).

Module names equal the checkpoint's tensor names, so `state_dict()` keys are the Hub names (the MTP
layer's without its `model.layers.{N}.` prefix). One forward serves a prefill of many tokens and a
verify of k tokens appended to cached sequences: every sequence of a batch appends the same number
of tokens, each at its own cached length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from glm5mtp_cli.core.cached import CachedRows, cached_rows
from glm5mtp_cli.core.family import refuse_tree
from glm5mtp_cli.models.glm5.config import ModelConfig
from glm5mtp_cli.models.glm5.attention import BatchContext, MLAttention
from glm5mtp_cli.models.glm5.layers import MLP, MoE, RMSNorm, norm_pair, rope_cos_sin


@dataclass
class ForwardOut:
    logits: torch.Tensor  # [B, R, V] for the rows asked for
    hidden: torch.Tensor  # [B, R, H] after the final norm (target) / shared_head.norm (MTP)
    prenorm: torch.Tensor | None = None  # MTP only: block output before shared_head.norm
    hidden_all: torch.Tensor | None = None  # target only: normed hiddens of every appended row
    pending = None  # no fixed-size state to commit (engine/target.py)


@dataclass
class TrainOut:
    logits: torch.Tensor
    hidden: torch.Tensor
    aux_loss: torch.Tensor


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = MLAttention(cfg, cfg.has_indexer(layer))
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, bc, kv_layer, idx_layer, prev_topk, indexer_losses=None):
        a, topk = self.self_attn(self.input_layernorm(h), bc, kv_layer, idx_layer, prev_topk, indexer_losses)
        normed, h = self.post_attention_layernorm.after_add(a, h)
        return h + self.mlp(normed), topk


def rope_context(cfg: ModelConfig, starts: torch.Tensor, t: int, mla=None, indexer=None) -> BatchContext:
    pos = starts[:, None] + torch.arange(t, device=starts.device)
    cos, sin = rope_cos_sin(pos, cfg.qk_rope_head_dim, cfg.rope_theta)
    return BatchContext(starts, cos, sin, mla, indexer)


def batch_context(cfg: ModelConfig, caches: list, t: int, device) -> BatchContext:
    """The context of a forward appending t rows to each of `caches` (None: cache-free)."""
    if caches[0] is None:
        return rope_context(cfg, torch.zeros(len(caches), dtype=torch.long, device=device), t)
    starts, rows = cached_rows(caches, t, device)
    return rope_context(cfg, starts, t, rows["mla"], rows.get("indexer"))


def _rows(h: torch.Tensor, rows: str | torch.Tensor) -> torch.Tensor:
    """'all', 'last', or a [B] tensor: row rows[b] of sequence b (-> [B, 1, H])."""
    if isinstance(rows, str):
        return h if rows == "all" else h[:, -1:]
    return h.gather(1, rows.view(-1, 1, 1).expand(-1, 1, h.shape[-1]))


class _Body(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Glm5ForCausalLM(nn.Module):
    """The GLM-5 target as the engine's Target (engine/target.py): paged rows only."""

    reads_slots = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = _Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # Position of each layer in the MLA and indexer pools (shared layers hold no indexer keys).
        self.idx_layer = {}
        for i in range(cfg.num_hidden_layers):
            if cfg.has_indexer(i):
                self.idx_layer[i] = len(self.idx_layer)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.embed_tokens

    def context(self, starts: torch.Tensor, t: int, rows: dict[str, CachedRows], slots=None) -> BatchContext:
        """The context of a forward appending t rows at `starts` through `rows` (static buffers)."""
        return rope_context(self.cfg, starts, t, rows["mla"], rows.get("indexer"))

    def commit(self, pending, kept: torch.Tensor) -> None:
        """Nothing to commit: every component rolls back by length."""

    def _run(self, input_ids, bc: BatchContext, indexer_losses=None):
        h = self.model.embed_tokens(input_ids)
        topk = None
        for i, layer in enumerate(self.model.layers):
            h, topk = layer(h, bc, i, self.idx_layer.get(i), topk, indexer_losses)
        return self.model.norm(h)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, caches: list, rows: str | torch.Tensor = "all",
                real: torch.Tensor | None = None, plan=None) -> ForwardOut:
        """Append input_ids [B, T] to each sequence's cache; logits and normed hiddens for `rows`.
        real (the Target protocol's padding rows): nothing to keep them out of, every component is
        paged rows that the caller cuts back. plan: a verify's (None or a chain: causal rows)."""
        refuse_tree(plan)
        bc = batch_context(self.cfg, caches, input_ids.shape[1], input_ids.device)
        out = self.forward_batch(input_ids, bc, rows)
        for cache in caches:
            if cache is not None:
                cache.length += input_ids.shape[1]
        return out

    @torch.no_grad()
    def forward_batch(self, input_ids: torch.Tensor, bc: BatchContext, rows: str | torch.Tensor = "all") -> ForwardOut:
        """The forward as a function of device tensors alone (what a CUDA graph captures); the
        caller keeps the caches' lengths."""
        h_all = self._run(input_ids, bc)
        h = _rows(h_all, rows)
        return ForwardOut(self.lm_head(h), h, hidden_all=h_all)

    def forward_train(self, input_ids: torch.Tensor) -> TrainOut:
        """Cache-free forward over whole sequences, with the DSA indexer's KL loss."""
        losses: list[torch.Tensor] = []
        bc = batch_context(self.cfg, [None] * input_ids.shape[0], input_ids.shape[1], input_ids.device)
        h = self._run(input_ids, bc, losses)
        aux = torch.stack(losses).sum() if losses else h.new_zeros(())
        return TrainOut(self.lm_head(h), h, aux)


class Glm5MtpLayer(nn.Module):
    """The MTP layer (`model.layers.{N}`): eh_proj over [enorm(embed(t[i+1])), hnorm(h[i])], a full
    decoder block with its own caches, then shared_head.norm. Embeddings and head are the target's."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.block = DecoderLayer(cfg, cfg.mtp_layer_index)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # The block's modules sit at the top level of the checkpoint's layer N.
        self.register_state_dict_post_hook(_unnest_block)
        self.register_load_state_dict_pre_hook(_nest_block)

    def context(self, starts: torch.Tensor, t: int, rows: dict[str, CachedRows]) -> BatchContext:
        """The context of a forward appending t rows at `starts` through `rows` (static buffers)."""
        return rope_context(self.cfg, starts, t, rows["mla"], rows.get("indexer"))

    def _run(self, token_ids, hidden, bc: BatchContext, embed: nn.Embedding, indexer_losses=None):
        t = token_ids.shape[1]
        e = embed(token_ids)
        # Row i sits at position i; the embedding of the row at position 0 is zeroed (vLLM, SGLang).
        pos = bc.starts[:, None] + torch.arange(t, device=token_ids.device)
        e = e.masked_fill((pos == 0)[..., None], 0.0)
        x = self.eh_proj(norm_pair(self.enorm, e, self.hnorm, hidden.to(e.dtype)))
        y, _ = self.block(x, bc, 0, 0, None, indexer_losses)
        return y

    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor, hidden: torch.Tensor, caches: list, embed: nn.Embedding,
                head: nn.Linear, rows: str | torch.Tensor = "all") -> ForwardOut:
        """Append drafter rows: token_ids [B, T] (t[i+1]) paired with hidden [B, T, H] (h[i])."""
        bc = batch_context(self.cfg, caches, token_ids.shape[1], token_ids.device)
        out = self.forward_batch(token_ids, hidden, bc, embed, head, rows)
        for cache in caches:
            if cache is not None:
                cache.length += token_ids.shape[1]
        return out

    @torch.no_grad()
    def forward_batch(self, token_ids: torch.Tensor, hidden: torch.Tensor, bc: BatchContext, embed: nn.Embedding,
                      head: nn.Linear, rows: str | torch.Tensor = "all") -> ForwardOut:
        """The forward as a function of device tensors alone (what a CUDA graph captures)."""
        y = _rows(self._run(token_ids, hidden, bc, embed), rows)
        g = self.shared_head.norm(y)
        return ForwardOut(head(g), g, y)

    def forward_train(self, hidden: torch.Tensor, next_ids: torch.Tensor, embed_tokens: nn.Embedding,
                      lm_head: nn.Linear) -> TrainOut:
        losses: list[torch.Tensor] = []
        bc = batch_context(self.cfg, [None] * next_ids.shape[0], next_ids.shape[1], next_ids.device)
        y = self._run(next_ids, hidden, bc, embed_tokens, losses)
        g = self.shared_head.norm(y)
        aux = torch.stack(losses).sum() if losses else g.new_zeros(())
        return TrainOut(lm_head(g), g, aux)


def _unnest_block(module, state_dict, prefix, local_metadata) -> None:
    for key in [k for k in state_dict if k.startswith(prefix + "block.")]:
        state_dict[prefix + key[len(prefix) + len("block."):]] = state_dict.pop(key)


def _nest_block(module, state_dict, prefix, *args) -> None:
    for key in [k for k in state_dict if k.startswith(prefix)]:
        rest = key[len(prefix):]
        if rest.split(".")[0] in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
            state_dict[prefix + "block." + rest] = state_dict.pop(key)
