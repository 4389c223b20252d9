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

# the model's mixing weights, collapse (also with the block's norm) and expand (hc_weights_ref's docstring)
from kernels.mhc import hc_collapse, hc_collapse_norm, hc_expand, hc_weights  # noqa: F401


def expand_streams(x: torch.Tensor, n: int) -> torch.Tensor:
    """[T, D] embeddings -> [T, n, D] streams (plain copies)."""
    return x.unsqueeze(-2).expand(*x.shape[:-1], n, x.shape[-1]).contiguous()


def contract_streams(streams: torch.Tensor) -> torch.Tensor:
    """[T, n, D] -> [T, D]: the unweighted mean (GLM-5-Next has no learned read-out)."""
    return streams.mean(dim=-2)
