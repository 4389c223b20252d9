"""The GLM-5-Next MTP layer (`layers.{num_hidden_layers}`) and the math of its greedy draft chain
(REFERENCE-glm5next section 9; transformers has no MTP layer, the math follows the public engines).

Row i of the MTP layer's cache is built from (token t[i+1], target hidden h[i]):

    x = eh_proj([enorm(E t[i+1]) ; hnorm(h[i])])      (embedding zeroed at row 0)
    x = x + MLA_with_own_pooled_indexer(input_layernorm(x))
    x = x + MoE(post_attention_layernorm(x))          (plain residual: no mHC streams)
    g = shared_head.norm(x);   draft logits = target lm_head(g)

h is the target's post-norm hidden (mean of the streams, then model.norm), never the stream state.
A chain feeds each draft back with g in place of h. Only rows whose (token, hidden) pair is real are
committed to the cache; chain rows are rolled back.

The module holds the parameters; it runs over the drafter's pools (paged.mtp_forward behind
pooled.PooledMtp, which engine/mtp_head.MtpHead drives) or over whole windows (training.py), and
one sequence at a time in the tests' reference (tests/glm5next_reference.py).
"""

from __future__ import annotations

from torch import nn

from glm5mtp_cli.models.glm5.layers import RMSNorm
from glm5mtp_cli.models.glm5_next.attention import MlaLayer
from glm5mtp_cli.models.glm5_next.config import NextConfig
from glm5mtp_cli.models.glm5_next.decoder import make_mlp


class _SharedHead(nn.Module):
    def __init__(self, cfg: NextConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


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
