"""Manifold-constrained hyper-connections (mHC): the residual of GLM-5-Next is n = hc_mult streams
per token instead of one (REFERENCE-glm5next section 4).

Each block site (attention, FFN) reads the flattened streams, computes per token
  pre  [n]   : how the streams collapse into the block input,
  post [n]   : how the block output spreads back onto the streams,
  comb [n,n] : a doubly-stochastic (Sinkhorn) mix of the old streams,
then X <- post (x) y + comb^T X. All mixing weights are fp32; post/comb are cast to the stream dtype
before the update, as transformers does, so bf16 runs round the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def expand_streams(x: torch.Tensor, n: int) -> torch.Tensor:
    """[T, D] embeddings -> [T, n, D] streams (plain copies)."""
    return x.unsqueeze(-2).expand(*x.shape[:-1], n, x.shape[-1]).contiguous()


def contract_streams(streams: torch.Tensor) -> torch.Tensor:
    """[T, n, D] -> [T, D]: the unweighted mean (GLM-5-Next has no learned read-out)."""
    return streams.mean(dim=-2)


def hc_weights(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
               norm_eps: float, hc_eps: float, sinkhorn_iters: int):
    """Mixing weights of one HC site.

    streams [T, n, D]; fn [(2+n)n, nD]; base [(2+n)n]; scale [3].
    Returns pre [T, n], post [T, n], comb [T, n, n] (all fp32); comb[j, k] weights input stream j
    into output stream k.
    """
    n = streams.shape[-2]
    f = streams.reshape(*streams.shape[:-2], -1).float()
    # unweighted RMSNorm with rms_norm_eps (not hc_eps)
    f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + norm_eps)
    m = F.linear(f, fn.float())
    base, scale = base.float(), scale.float()
    m_pre, m_post, m_comb = m.split([n, n, n * n], dim=-1)
    b_pre, b_post, b_comb = base.split([n, n, n * n])
    pre = torch.sigmoid(m_pre * scale[0] + b_pre) + hc_eps
    post = 2 * torch.sigmoid(m_post * scale[1] + b_post)
    comb = torch.softmax((m_comb * scale[2] + b_comb).view(*m_comb.shape[:-1], n, n), dim=-1) + hc_eps
    # Sinkhorn: start and end with a column normalisation (sum over dim -2)
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Block input: sum_i pre_i X_i, computed in fp32 and cast to the stream dtype."""
    return (pre.unsqueeze(-1) * streams).sum(-2).to(streams.dtype)


def hc_expand(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams: X_k <- post_k y + sum_j comb[j, k] X_j."""
    dt = streams.dtype
    return post.to(dt).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), streams)
