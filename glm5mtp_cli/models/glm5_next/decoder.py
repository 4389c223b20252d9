"""The GLM-5-Next target: embed -> n mHC streams -> layers (KDA or indexed MLA, dense MLP or MoE)
-> unweighted mean of the streams -> norm -> lm_head (REFERENCE-glm5next section 3).

The modules, with parameters named as the checkpoint's and no forward of their own: they run over
the engine's pools, B sequences at once (paged.target_forward behind pooled.PooledTarget), or
differentiably over whole windows (training.py); NextBlock.run is the block around whichever
attention its caller runs. tests/glm5next_reference.py runs them one sequence at a time, the
reference those forwards are tested against.

The hidden row the MTP layer reads is the post-norm one (never the stream state).
"""

from __future__ import annotations

import torch
from torch import nn

from glm5mtp_cli.models.glm5.layers import MLP, MoE, RMSNorm
from glm5mtp_cli.models.glm5_next.attention import MlaLayer
from glm5mtp_cli.models.glm5_next.config import NextConfig
from glm5mtp_cli.models.glm5_next.kda import KdaLayer
from glm5mtp_cli.models.glm5_next.mhc import hc_collapse_norm, hc_expand, hc_weights

# How a verify keeps what rollback needs for KDA layers: "replay" keeps the kernel inputs and re-runs
# the kept rows' recurrent steps from the untouched committed S; "states" keeps S after every row.
# Measured on one KDA layer at GLM-5.3-Flash sizes, gamma 3, this 2-core CPU, one thread
# (OMP_NUM_THREADS=1 python3 tests/bench_rollback.py --gamma 3 --reps 10):
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

    def run(self, streams: torch.Tensor, attend):
        """The block around its attention: streams [..., T, n, D]; attend(a) -> (y, pending) attends
        the normed rows a [..., T, D] (one sequence's past, or B sequences' pools: paged.py)."""
        pre, post, comb = self._hc("attn", streams)
        norm = self.input_layernorm
        y, pending = attend(hc_collapse_norm(streams, pre, norm.weight, norm.eps))
        streams = hc_expand(streams, y, post, comb)
        pre, post, comb = self._hc("ffn", streams)
        norm = self.post_attention_layernorm
        y = self.mlp(hc_collapse_norm(streams, pre, norm.weight, norm.eps))
        return hc_expand(streams, y, post, comb), pending


class Glm5NextForCausalLM(nn.Module):
    """state_dict keys = checkpoint names without `model.language_model.` (+ top-level lm_head.weight)."""

    def __init__(self, cfg: NextConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(NextBlock(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
