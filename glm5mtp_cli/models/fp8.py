"""Weights that stay block-scaled FP8 on the device (GLM-5-FP8: float8_e4m3fn + fp32 `weight_scale_inv`,
one scale per 128x128 block), for any family: its bias-free nn.Linear projections become Fp8Linear,
and a module with an `as_fp8(block)` method (stacked experts: models/glm5/layers.Fp8Experts) becomes
what that returns.

Which tensors are FP8 is what the checkpoint says: the loader (checkpoint/load.py) builds a family's
modules on the meta device, shards them, then `convert` swaps every such module whose checkpoint
weight is stored FP8, and fills the new buffers with the stored bytes and scales. Nothing
dequantized is kept. Before filling, `join_inputs` lays FP8 projections of one input (a module's
`joined_groups()`) out as rows of one matrix, which one GEMM reads on CUDA (`joined`); after filling,
`join_loaded` does the same for such groups loaded in the model dtype.

Compute (`--dtype` stays the activation dtype):
- CUDA: kernels/fp8_block.fp8_block_matmul (Triton, any row count: split-K for decode and verify
  widths, row tiles for prefill) and kernels/moe.moe_experts_fp8 (the chosen experts read in place).
  No host sync and no data-dependent shape: the forwards can be captured in CUDA graphs.
- CPU: the weight is dequantized just before its matmul, in chunks of whole 128-row blocks of at most
  `CPU_CHUNK_BYTES` of fp32 (the transient is that chunk, its expanded scales of the same size and its
  copy in the activation dtype); experts: only the chosen ones. Dequantizing is fp32 `w * scale`, then
  a cast to the activation dtype: exactly the weights an unquantized twin loaded from the same
  checkpoint holds, so CPU logits equal the twin's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels._triton import use_kernels
from kernels.fp8_block import fp8_block_dequant, fp8_block_dequant_ref, fp8_block_matmul

from glm5mtp_cli.errors import UserError

FP8 = torch.float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"
# GLM-5-FP8's quantization_config: what init-random --fp8 and quantize write, and what random FP8 weights mean
FP8_QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128]}
CPU_CHUNK_BYTES = 16 << 20  # fp32 bytes of one dequantized chunk on the CPU


def fp8_config(cfg):
    """cfg as an FP8 checkpoint's (GLM-5-FP8's quantization_config): random weights over it
    (checkpoint.random.RandomReader) make the family's quantized matrices FP8 with 128x128 block
    scales, and every byte prediction counts them so."""
    import dataclasses

    from glm5mtp_cli.core.families import family_of  # lazy: the families import this module

    family = family_of(cfg)
    if not hasattr(cfg, "quantization_config") or not any(
            family.is_fp8_quantized(cfg, n, s) for n, s in family.tensor_shapes(cfg)):
        raise UserError(f"--fp8: model type {cfg.model_type} has no FP8 layout here")
    return dataclasses.replace(cfg, quantization_config=dict(FP8_QUANT_CONFIG))


def scale_grid(rows: int, cols: int, block: int) -> tuple[int, int]:
    return -(-rows // block), -(-cols // block)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, block: int) -> torch.Tensor:
    """x [..., K] @ dequant(w [N, K])^T in x.dtype (see the module docstring for CUDA vs CPU)."""
    if use_kernels(x):
        return fp8_block_matmul(x, w, scale_inv, block)
    n, k = w.shape
    rows = max(block, CPU_CHUNK_BYTES // (4 * max(k, 1)) // block * block)
    if n <= rows:
        return F.linear(x, fp8_block_dequant_ref(w, scale_inv, block, torch.float32).to(x.dtype))
    parts = [F.linear(x, fp8_block_dequant_ref(w[r:r + rows], scale_inv[r // block:(r + rows) // block],
                                               block, torch.float32).to(x.dtype))
             for r in range(0, n, rows)]
    return torch.cat(parts, dim=-1)


class Fp8Linear(nn.Module):
    """A bias-free Linear over a block-scaled FP8 weight: buffers `weight` [out, in] float8_e4m3fn and
    `weight_scale_inv` [ceil(out/block), ceil(in/block)] fp32 (the checkpoint's names)."""

    def __init__(self, in_features: int, out_features: int, block: int = 128, device=None):
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8, device=device))
        self.register_buffer("weight_scale_inv", torch.empty(scale_grid(out_features, in_features, block),
                                                             dtype=torch.float32, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.block)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The real weight in `dtype`, made now (a transient for code that needs the matrix itself)."""
        return fp8_block_dequant(self.weight, self.weight_scale_inv, self.block, dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 block {self.block}"


def linear_weight(lin: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A Linear's weight matrix in `dtype`: dequantized now for an Fp8Linear, as held otherwise."""
    return lin.dequantized(dtype) if isinstance(lin, Fp8Linear) else lin.weight


# ---- swapping a (meta, sharded) module's FP8-stored weights for FP8 modules -------------------------------

def _scale_slice(name: str, part: tuple[int, int, int], full: int, block: int) -> tuple[int, int, int]:
    """The scale grid's slice for a weight slice (dim, start, stop) of a dimension of `full` values;
    a slice must fall on block boundaries (its end may be the dimension's end)."""
    dim, start, stop = part
    if start % block or (stop % block and stop != full):
        raise UserError(f"FP8 tensor '{name}': this rank's slice [{start}:{stop}] of dim {dim} does not fall on "
                        f"the {block}-wide scale blocks; choose a --tp that splits it on block boundaries")
    return dim, start // block, -(-stop // block)


def convert(module: nn.Module, reader, prefix: str, plan: dict | None, block: tuple[int, int]) -> int:
    """Swap, in place, every nn.Linear and `as_fp8` module of `module` whose checkpoint weight (`prefix`
    + its state_dict key) `reader` stores as FP8 for an Fp8Linear / what `as_fp8(block)` returns, on
    the meta device; add the scale grids' slices to `plan` (tensor parallel) next to their weights'.
    Returns how many modules were swapped.

    Raises UserError for non-square blocks or a rank slice that cuts a scale block."""
    # A tensor's checkpoint name is its state_dict key (state_dict hooks rename: the MTP layer's block,
    # per-expert views of the stacks), found by the tensor itself (an expert stack by its first view).
    key_of: dict[int, str] = {}
    for key, t in module.state_dict(keep_vars=True).items():
        key_of.setdefault(id(t if t._base is None else t._base), prefix + key)
    swaps = []
    for name, mod in module.named_modules():
        if name and type(mod) is nn.Linear and mod.bias is None and reader.stored_fp8(key_of.get(id(mod.weight), "")):
            swaps.append((name, key_of[id(mod.weight)], Fp8Linear(mod.in_features, mod.out_features, block[0],
                                                                  device="meta")))
        elif name and hasattr(mod, "as_fp8") and mod._parameters:
            first = key_of.get(id(next(iter(mod._parameters.values()))))  # e.g. the first expert's gate_proj
            if first is not None and reader.stored_fp8(first):
                swaps.append((name, first, mod.as_fp8(block[0])))
    if swaps and block[0] != block[1]:
        raise UserError(f"FP8 weights with {block[0]}x{block[1]} blocks: only square scale blocks are supported")
    for name, wname, new in swaps:
        parent_name, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent_name), child, new)
        if plan is None or not isinstance(new, Fp8Linear):
            continue  # expert parallel splits whole experts: each keeps all its scales
        if wname in plan:
            dim = plan[wname][0]
            full = reader.shape(wname)[dim]
            plan[wname + SCALE_SUFFIX] = _scale_slice(wname, plan[wname], full, block[0])
    return len(swaps)


# ---- projections of one input, read by one GEMM ----------------------------------------------------------

def _joinable(linears: list[nn.Module]) -> bool:
    if len(linears) < 2 or not all(isinstance(m, Fp8Linear) for m in linears):
        return False
    first = linears[0]
    return (all(m.block == first.block and m.in_features == first.in_features for m in linears)
            and all(m.out_features % m.block == 0 for m in linears[:-1]))


def _names(group: str) -> tuple[str, str]:
    return f"joined_{group}_weight", f"joined_{group}_scale_inv"


def join_inputs(module: nn.Module, device) -> None:
    """Give each group of FP8 projections of one input, as a submodule's `joined_groups()` names
    them ({group: its Fp8Linears in order}), one FP8 matrix and scale grid on `device` holding them
    all: the submodule's non-persistent buffers `joined_{group}_weight` / `joined_{group}_scale_inv`,
    each Fp8Linear's buffers views of its rows. Run between `convert` and loading: the loader fills
    the views in place, so no byte is held twice, and the submodule's forward reads the group with
    one GEMM (:func:`joined`): at GLM-5's dims q_a, the indexer's wk and kv_a took 35 us per decode
    step on the H200 as three GEMMs with their split-K sums, and 13 as one.

    A group stays apart unless all its modules are Fp8Linear of one block and input width and each
    but the last ends on a scale block (the GEMM finds a row's scales by row // block)."""
    for sub in module.modules():
        for group, linears in _groups(sub):
            if not _joinable(linears):
                continue
            first = linears[0]
            weight = torch.empty(sum(m.out_features for m in linears), first.in_features, dtype=FP8, device=device)
            scale = torch.empty(sum(m.weight_scale_inv.shape[0] for m in linears), first.weight_scale_inv.shape[1],
                                dtype=torch.float32, device=device)
            row = srow = 0
            for m in linears:
                rows, srows = m.out_features, m.weight_scale_inv.shape[0]
                m.weight, m.weight_scale_inv = weight[row:row + rows], scale[srow:srow + srows]
                row, srow = row + rows, srow + srows
            for name, t in zip(_names(group), (weight, scale)):
                sub.register_buffer(name, t, persistent=False)
            # what the forward needs, fixed now: no group lists or names rebuilt in each decode step
            sub._joined = {**getattr(sub, "_joined", {}),
                           group: (*_names(group), first.block, [m.out_features for m in linears])}


def _groups(sub: nn.Module):
    return (sub.joined_groups() if hasattr(sub, "joined_groups") else {}).items()


def _plain(mods: list[nn.Module]) -> bool:
    """Bias-free modules of one weight each (nn.Linear, or a bare weight holder), loaded, of one dtype,
    device and row shape."""
    weights = [m._parameters.get("weight") for m in mods]
    if len(mods) < 2 or any(w is None or w.is_meta or w.dtype == FP8 or m._parameters.get("bias") is not None
                            for m, w in zip(mods, weights)):
        return False
    first = weights[0]
    return all(w.dtype == first.dtype and w.device == first.device and w.shape[1:] == first.shape[1:] for w in weights)


def join_loaded(module: nn.Module) -> None:
    """join_inputs for groups loaded in the model dtype (`_plain`), after loading: each group's weights
    copied into one tensor, the submodule's non-persistent buffer `joined_{group}_weight`, and each
    module's weight made a view of its rows (the old storage is freed group by group, so no byte is
    held twice). A projection group is then one GEMM (:func:`joined`); GLM-5-Next's KDA layers read
    six projections of one input in every decode step (q, k, v, the gates' f_a, g_a, beta's b)."""
    for sub in module.modules():
        for group, mods in _groups(sub):
            if group in getattr(sub, "_joined", {}) or not _plain(mods):
                continue
            weight = torch.cat([m.weight.detach() for m in mods])
            row = 0
            for m in mods:
                rows = m.weight.shape[0]
                m.weight = nn.Parameter(weight[row:row + rows], requires_grad=m.weight.requires_grad)
                row += rows
            name = _names(group)[0]
            sub.register_buffer(name, weight, persistent=False)
            sub._joined = {**getattr(sub, "_joined", {}), group: (name, None, 0, [m.weight.shape[0] for m in mods])}


def joined_weight(sub: nn.Module, group: str) -> torch.Tensor | None:
    """`sub`'s joined `group` weight (join_inputs, join_loaded); None where the group was not joined,
    or off the kernels' inference path (training: its gradients reach each module's own weight)."""
    w_name = getattr(sub, "_joined", {}).get(group, (None,))[0]
    weight = sub._buffers.get(w_name)  # absent too where a caller took the joined buffers away
    return None if weight is None or torch.is_grad_enabled() else weight


def joined_output(sub: nn.Module, group: str, x: torch.Tensor) -> torch.Tensor | None:
    """`sub`'s `group` projections of x as one GEMM's output (the projections' outputs side by side);
    None where the group was not joined, or off the kernels' inference path (the CPU's own path,
    training): each projection then runs by itself."""
    weight = joined_weight(sub, group)
    if weight is None or not use_kernels(x):
        return None
    _, s_name, block, _ = sub._joined[group]
    return F.linear(x, weight) if s_name is None else fp8_block_matmul(x, weight, sub._buffers[s_name], block)


def joined(sub: nn.Module, group: str, x: torch.Tensor) -> list[torch.Tensor] | None:
    """joined_output split per projection."""
    out = joined_output(sub, group, x)
    return None if out is None else list(out.split(sub._joined[group][3], dim=-1))
