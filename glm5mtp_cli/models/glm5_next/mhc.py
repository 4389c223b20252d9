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

from kernels.mhc import hc_collapse, hc_expand, hc_mix  # noqa: F401 (the model's collapse and expand)


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
    into output stream k (kernels/mhc.py: hc_mix_ref, one kernel on CUDA).
    """
    f = streams.reshape(*streams.shape[:-2], -1).float()
    # unweighted RMSNorm with rms_norm_eps (not hc_eps)
    f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + norm_eps)
    return hc_mix(F.linear(f, fn.float()), base, scale, hc_eps, sinkhorn_iters)
