"""The one random initialiser: every random weight glm5mtp makes (init-random's checkpoints,
--random-weights, bench's random target and drafter, a training run's fresh weights) comes from
`random_tensor`, by checkpoint name.

Convention (that of the checkpoints init-random has always written):
- matrices (2-D and up): N(0, 0.02);
- 1-D `*.bias` (LayerNorm biases, e.g. the indexer's k_norm.bias): 0;
- 1-D `*_bias` offsets (the routers' e_score_correction_bias): N(0, 0.01), fp32, so that the
  routing bias is exercised rather than a no-op;
- every other 1-D tensor (norm weights): 1.
One generator per tensor, seeded by (seed, name): a tensor's values depend neither on the order
of generation nor on --layers (a truncated model equals the full one's first layers) nor on the
rank that reads it (the ranks of --tp hold exactly the slices of what one device would hold).
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import torch

from kernels.fp8_block import fp8_block_dequant_ref, fp8_block_quantize

WEIGHT_STD = 0.02
OFFSET_STD = 0.01
_CHUNK_ELEMS = 1 << 25  # fp32 values sampled at once: a full-width embedding's fp32 copy would be 4 GB


def _generator(seed: int, name: str, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return g


def random_tensor(name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """The random value of checkpoint tensor `name` (see the module docstring for the convention).
    Drawn on `device` (a CUDA generator's stream differs from the CPU's, deterministically)."""
    shape = tuple(shape)
    if len(shape) == 1:
        if name.endswith("_bias"):
            return torch.empty(shape, dtype=torch.float32, device=device).normal_(
                0.0, OFFSET_STD, generator=_generator(seed, name, device))
        fill = 0.0 if name.endswith(".bias") else 1.0
        return torch.full(shape, fill, dtype=dtype, device=device)
    # Sampled in fp32 a slab of rows at a time, written into the result's dtype.
    g = _generator(seed, name, device)
    out = torch.empty(shape, dtype=dtype, device=device)
    per_row = max(1, out[0].numel())
    rows = max(1, _CHUNK_ELEMS // per_row)
    for r in range(0, shape[0], rows):
        n = min(rows, shape[0] - r)
        out[r:r + n] = torch.empty((n, *shape[1:]), device=device).normal_(0.0, WEIGHT_STD, generator=g)
    return out


@torch.no_grad()
def fill_random(module: torch.nn.Module, prefix: str, seed: int) -> None:
    """Give every state_dict entry of `module` (named `prefix + key` in the checkpoint) its random
    value, in place; views of fused tensors (stacked experts) get their per-name values."""
    for key, dst in module.state_dict(keep_vars=True).items():
        dst.copy_(random_tensor(prefix + key, tuple(dst.shape), seed, torch.float32, "cpu"))


class RandomReader:
    """Stands in for a CheckpointReader: every tensor of the config's layout, drawn by
    `random_tensor` on the device it is asked for, so GLM-5's real dimensions run without 1.5 TB
    on disk. Values are drawn whole before any slicing.

    For a config with an FP8 quantization_config, the family's quantized matrices are stored as an
    FP8 checkpoint would hold them: float8_e4m3fn plus `_scale_inv` (
    fp8_block_quantize of the random fp32 value, on the device asked for); asked for in another
    dtype, such a tensor comes back dequantized, as CheckpointReader.get does."""

    def __init__(self, cfg: Any, seed: int = 0):
        from glm5mtp_cli.core.families import family_of

        self.folder = Path(f"<random weights: {cfg.source}>")
        self.seed = seed
        self.bytes_read = 0
        self.shapes = dict(family_of(cfg).tensor_shapes(cfg))
        self.block = tuple(getattr(cfg, "fp8_block", (128, 128)))
        self.fp8: set[str] = set()
        if getattr(cfg, "fp8", False):
            family = family_of(cfg)
            self.fp8 = {n for n, s in self.shapes.items() if family.is_fp8_quantized(cfg, n, s)}
            for n in self.fp8:
                s = self.shapes[n]
                self.shapes[n + "_scale_inv"] = (-(-s[0] // self.block[0]), -(-s[1] // self.block[1]))
        self._last: tuple[str, str, torch.Tensor, torch.Tensor] | None = None  # (name, device, weight, scale)

    def has(self, name: str) -> bool:
        return name in self.shapes

    def stored_fp8(self, name: str) -> bool:
        return name in self.fp8

    def shape(self, name: str) -> list[int]:
        return list(self.shapes[name])

    def file_of(self, name: str) -> str:
        return "random"

    def _quantized(self, name: str, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp8 weight, scale) of an FP8 name, kept for the one next call (its scale's read)."""
        if self._last is None or self._last[:2] != (name, str(device)):
            w = random_tensor(name, self.shapes[name], self.seed, torch.float32, device)
            self._last = (name, str(device), *fp8_block_quantize(w, self.block))
        return self._last[2], self._last[3]

    def get(self, name: str, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> torch.Tensor:
        if name in self.fp8 or (name.endswith("_scale_inv") and name[: -len("_scale_inv")] in self.fp8):
            is_scale = name not in self.fp8
            w, s = self._quantized(name[: -len("_scale_inv")] if is_scale else name, device)
            if is_scale:
                return s
            if dtype == torch.float8_e4m3fn:
                return w
            return fp8_block_dequant_ref(w, s, self.block, torch.float32).to(dtype or torch.float32)
        t = random_tensor(name, self.shapes[name], self.seed, dtype or torch.float32, device)
        return t.to(dtype) if dtype is not None and t.dtype != dtype else t

    def get_slice(self, name: str, dim: int, start: int, stop: int, dtype: torch.dtype | None = None,
                  device: str | torch.device = "cpu") -> torch.Tensor:
        return self.get(name, dtype, device).narrow(dim, start, stop - start)

    def close(self) -> None:
        pass
