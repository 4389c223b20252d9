"""The byte counts every family's formulas share: one weight tensor's bytes as its family stores or
holds it (fp32 where the family keeps fp32, FP8 matrices with their block scales), a tensor's or
the head's share on one of --tp ranks, and the scratch of the MoE both families run
(models/glm5/layers.Experts) on the CPU; an element's size is core/dtypes.py's. diagnostics/sizing
asks each family (its `sizing` module) for what differs between families; both build on these."""

from __future__ import annotations

import math

from glm5mtp_cli.core.families import family_of


def tensor_bytes(cfg, name: str, shape: tuple[int, ...], elem_bytes: int,
                 fp8_block: tuple[int, int] | None = None, held: bool = False) -> int:
    """Bytes of one weight tensor of cfg's family: fp32 for the tensors the checkpoint stores in fp32
    (held=False) or the model keeps in fp32 (held=True: routers, indexer weighting); the matrices the
    family's FP8 checkpoint quantizes (is_fp8_quantized) at 1 byte plus one fp32 scale per block when
    fp8_block is given; else `elem_bytes` each."""
    family = family_of(cfg)
    n = math.prod(shape)
    if (family.keeps_fp32(name) if held else family.stored_fp32(name)):
        return 4 * n
    if fp8_block is not None and family.is_fp8_quantized(cfg, name, shape):
        b0, b1 = fp8_block
        return n + 4 * (-(-shape[0] // b0)) * (-(-shape[1] // b1))
    return elem_bytes * n


def rank_share(cfg, name: str, nbytes: int, tp: int) -> int:
    """One rank's bytes of a tensor's `nbytes` under --tp: 1/tp of what the family's sharding splits
    (heads, experts, MLP columns; rounded up), all of what every rank holds whole."""
    return -(-nbytes // tp) if tp > 1 and family_of(cfg).split_over_ranks(name) else nbytes


def head_bytes(cfg, rows: int, elem_bytes: int, tp: int) -> int:
    """One rank's lm_head bytes over `rows` vocabulary rows: ceil(rows/tp) rows (rank 0 holds the
    most: parallel.vocab_range)."""
    return -(-rows // tp) * cfg.hidden_size * elem_bytes


# Bytes per element of one (token, expert) pair's three matrices at the peak of Experts._gathered on
# the CPU. Plain stacks: the three gathered copies, in the activation dtype. FP8 stacks: gate and up
# kept dequantized in the activation dtype while down goes through its gathered FP8 copy (1), its
# fp32 values (4), the expanded scales (4) and their product (4). Measured on a 512x1024 stack at
# 32 pairs: 12 and 6 bytes (plain, fp32 and bf16), 20 and 17 (FP8 under fp32 and bf16).
_FP8_DEQUANT_BYTES = 13


def moe_gather_bytes(cfg, tensors: list[tuple[str, tuple[int, ...]]], elem_bytes: int) -> int:
    """Peak scratch of the MoE on the CPU, its largest layer's: up to Experts.GATHER_MAX_PAIRS
    (token, expert) pairs, it copies out (FP8: dequantizes) every chosen expert's matrices at once;
    more pairs loop over the hit experts one at a time (a few matrices), so this bounds any row
    count but a static forward's (which always gathers). `tensors`: cfg's (name, shape) list."""
    from glm5mtp_cli.models.glm5.layers import Experts  # the modules: only once a load is sized

    family = family_of(cfg)
    k = cfg.num_experts_per_tok
    pairs = Experts.GATHER_MAX_PAIRS // k * k
    fp8 = getattr(cfg, "fp8", False)
    peak = 0
    for name, shape in tensors:
        if name.endswith(".mlp.experts.0.gate_proj.weight"):  # one per MoE layer (HF names, both families)
            per = (2 * elem_bytes + _FP8_DEQUANT_BYTES if fp8 and family.is_fp8_quantized(cfg, name, shape)
                   else 3 * elem_bytes)
            peak = max(peak, per * pairs * math.prod(shape))
    return peak
