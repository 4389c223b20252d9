"""Triton kernels for the decode hot path, each beside its PyTorch reference.

Every op lives in its own module with three functions: ``<op>_ref`` (plain PyTorch, fp32 math,
the definition), ``<op>_triton`` (checks shapes, allocates, launches) and ``<op>`` (the
dispatcher: Triton for CUDA tensors when Triton imports, else the reference)::

    from kernels.rmsnorm import rmsnorm                    # rmsnorm(x, weight, eps, residual=None)
    from kernels.rope import rope_interleaved              # rope_interleaved(x, cos, sin)
    from kernels.fp8_block import fp8_block_dequant, fp8_block_matmul
    from kernels.paged import indexer_scores_paged, mla_attention_paged   # a batch over the paged pools
    from kernels.moe import moe_experts                        # routed experts of few tokens

The functions are not re-exported here, so that ``kernels.rmsnorm`` stays the module. Importing
this package never needs Triton (see ``kernels._triton``). No ``__version__`` on purpose:
transformers probes an unrelated package that is also imported as ``kernels``.
"""

from ._triton import HAVE_TRITON

__all__ = ["HAVE_TRITON"]
