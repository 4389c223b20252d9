"""The GLM-5-Next target: embed -> n mHC streams -> layers (KDA or indexed MLA, dense MLP or MoE)
-> unweighted mean of the streams -> norm -> lm_head (REFERENCE-glm5next section 3).

One sequence per call. Every forward goes through a `SequenceState` and returns pending rows; the
caller commits them to an accepted prefix:

    logits, hidden = model.prefill(tokens, state)              # chunks, each committed whole
    logits, hidden = model.decode(token, state)
    logits, hidden, pending = model.verify(tokens, state)      # gamma+1 rows, state untouched
    model.commit(state, pending, keep)                         # keep the first `keep` rows

`hidden` is the post-norm 4096-wide row the MTP layer reads (never the stream state).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from glm5mtp_cli.models.glm5.layers import MLP, MoE, RMSNorm
from glm5mtp_cli.models.glm5_next.attention import MlaLayer, MlaPending
from glm5mtp_cli.models.glm5_next.config import NextConfig
from glm5mtp_cli.models.glm5_next.kda import CHUNK, KdaLayer, KdaPending
from glm5mtp_cli.models.glm5_next.mhc import contract_streams, expand_streams, hc_collapse, hc_expand, hc_weights
from glm5mtp_cli.models.glm5_next.state import SequenceState

# How a verify keeps what rollback needs for KDA layers: "replay" keeps the kernel inputs and re-runs
# the kept rows' recurrent steps from the untouched committed S; "states" keeps S after every row.
# Measured on one KDA layer at GLM-5.3-Flash sizes, gamma 3, this 2-core CPU, one thread
# (python3 -m glm5mtp_cli.models.glm5_next.bench_rollback --gamma 3 --reps 10):
#   states: verify 88-91 ms + rollback 0.35 ms, 16 MiB extra per layer (544 MiB per sequence)
#   replay: verify 90-92 ms + rollback 1.2-3.8 ms (1.2 ms per kept row), 0.5 MiB extra per layer
# Time is within ~3 % (the projections, 60 ms, dominate both); memory is 32x smaller with replay,
# and KDA state is what limits concurrency, so replay is the default; states is the test reference.
DEFAULT_ROLLBACK = "replay"


def make_mlp(cfg: NextConfig, moe: bool) -> nn.Module:
    """Dense SwiGLU or the noaux_tc MoE of GLM-5, both with GLM-5-Next's asymmetric clamp."""
    if moe:
        return MoE(cfg, swiglu_limit=cfg.swiglu_limit)
    return MLP(cfg.hidden_size, cfg.intermediate_size, swiglu_limit=cfg.swiglu_limit)


class NextBlock(nn.Module):
    """One trunk layer; parameter names follow the checkpoint's `layers.N.*` (hc_attn_fn, ...)."""

    def __init__(self, cfg: NextConfig, layer: int):
        super().__init__()
        n, d = cfg.hc_mult, cfg.hidden_size
        self.cfg, self.layer, self.kda = cfg, layer, cfg.is_kda(layer)
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", nn.Parameter(torch.empty((2 + n) * n, n * d, dtype=torch.float32)))
            setattr(self, f"hc_{site}_base", nn.Parameter(torch.empty((2 + n) * n, dtype=torch.float32)))
            setattr(self, f"hc_{site}_scale", nn.Parameter(torch.empty(3, dtype=torch.float32)))
        self.input_layernorm = RMSNorm(d, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, eps=cfg.rms_norm_eps)
        self.self_attn = KdaLayer(cfg) if self.kda else MlaLayer(cfg)
        self.mlp = make_mlp(cfg, cfg.is_moe(layer))

    def _hc(self, site: str, streams: torch.Tensor):
        c = self.cfg
        return hc_weights(streams, getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_base"),
                          getattr(self, f"hc_{site}_scale"), c.rms_norm_eps, c.hc_eps, c.hc_sinkhorn_iters)

    def forward(self, streams: torch.Tensor, past, kda_mode: str = "final", chunk: int = CHUNK):
        """streams [T, n, D]; past: (S, window) for a KDA layer, an MlaPast otherwise."""
        if self.kda:
            return self.run(streams, lambda a: self.self_attn(a, past[0], past[1], mode=kda_mode, chunk=chunk))
        return self.run(streams, lambda a: self.self_attn(a, past))

    def run(self, streams: torch.Tensor, attend):
        """The block around its attention: streams [..., T, n, D]; attend(a) -> (y, pending) attends
        the normed rows a [..., T, D] (one sequence's past, or B sequences' pools: paged.py)."""
        pre, post, comb = self._hc("attn", streams)
        y, pending = attend(self.input_layernorm(hc_collapse(streams, pre)))
        streams = hc_expand(streams, y, post, comb)
        pre, post, comb = self._hc("ffn", streams)
        y = self.mlp(self.post_attention_layernorm(hc_collapse(streams, pre)))
        return hc_expand(streams, y, post, comb), pending


@dataclass
class StepPending:
    """Pending rows of one forward over T rows starting at position `start`."""

    start: int
    rows: int
    layers: dict[int, KdaPending | MlaPending]


class Glm5NextForCausalLM(nn.Module):
    """state_dict keys = checkpoint names without `model.language_model.` (+ top-level lm_head.weight)."""

    def __init__(self, cfg: NextConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(NextBlock(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def new_state(self, capacity: int) -> SequenceState:
        p = self.lm_head.weight
        return SequenceState.alloc(self.cfg, capacity, dtype=p.dtype, device=p.device)

    def forward_rows(self, tokens: torch.Tensor, state: SequenceState, kda_mode: str = "final",
                     chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor, StepPending]:
        """Rows tokens [T] at positions state.length.. ; state is read, not written.
        Returns (logits [T, V], hidden [T, D] post-norm, pending)."""
        streams = expand_streams(self.embed_tokens(tokens), self.cfg.hc_mult)
        pending: dict[int, KdaPending | MlaPending] = {}
        for i, block in enumerate(self.layers):
            if block.kda:
                slot = state.kda[i]
                past = (slot.state, slot.window)
            else:
                past = state.indexed[i].past()
            streams, pending[i] = block(streams, past, kda_mode, chunk)
        hidden = self.norm(contract_streams(streams))
        return self.lm_head(hidden), hidden, StepPending(state.length, tokens.shape[0], pending)

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

    # ---- the three ways an engine calls the target ------------------------------------------
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
