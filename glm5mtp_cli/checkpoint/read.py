"""Read tensors lazily from a folder of safetensors shards, dequantizing FP8 128x128 blocks unless
the caller asks for float8_e4m3fn (models/fp8.py's modules keep the stored bytes and their scales).

Memory rule: never the whole checkpoint at once. A reader keeps at most a couple of shards open
(memory-mapped by safetensors) and copies out one tensor (or one slice of it) at a time. Every
failure (a missing shard, a corrupt header, a tensor the index lists but its shard lacks) is one
line naming the file and the tensor.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

import torch

from glm5mtp_cli.errors import UserError, short_error
from kernels.fp8_block import fp8_block_dequant_ref

_FP8_NAMES = ("F8_E4M3", "FLOAT8_E4M3FN")  # safetensors' dtype name for float8_e4m3fn
# bytes an element takes, by safetensors' dtype name (those of a whole byte or more; F4 and F6 pack)
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, **dict.fromkeys(_FP8_NAMES, 1), "F8_E4M3FNUZ": 1, "F8_E5M2": 1,
             "F8_E5M2FNUZ": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
             "I64": 8, "U64": 8, "F64": 8, "C64": 8}


class CheckpointReader:
    """Lazy tensor access over a folder of safetensors shards.

    Keeps at most `max_open` shards open (least recently used closed first). `files_opened`
    records every shard ever opened, so tests can prove a run touched only the shards it needed.
    """

    def __init__(self, folder: str | os.PathLike, weight_map: dict[str, str], max_open: int = 2,
                 block: tuple[int, int] = (128, 128)):
        self.folder = Path(folder)
        self.weight_map = dict(weight_map)
        self.max_open = max_open
        self.block = block
        self.files_opened: set[str] = set()
        self.bytes_read = 0  # bytes copied out of the shards (tests: a rank reads only its slices)
        self._open: OrderedDict[str, object] = OrderedDict()
        self._keys: dict[str, set[str]] = {}  # names each opened shard holds (small: names only)

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def file_of(self, name: str) -> str:
        if name not in self.weight_map:
            raise UserError(f"tensor '{name}' is not in the checkpoint at {self.folder} (no shard lists it)")
        return self.weight_map[name]

    def _handle(self, file: str):
        from safetensors import safe_open

        if file in self._open:
            self._open.move_to_end(file)
            return self._open[file]
        path = self.folder / file
        if not path.is_file():
            raise UserError(f"shard file '{path}' is missing")
        try:
            handle = safe_open(str(path), framework="pt")
        except Exception as e:  # SafetensorError (bad header) or OSError
            raise UserError(f"shard file '{path}' is corrupt or unreadable ({short_error(e)})") from None
        self.files_opened.add(file)
        self._open[file] = handle
        self._keys[file] = set(handle.keys())
        while len(self._open) > self.max_open:
            self._open.popitem(last=False)
        return handle

    def _holding(self, name: str):
        """The open shard that holds `name`, after checking the shard really has it."""
        file = self.file_of(name)
        handle = self._handle(file)
        if name not in self._keys[file]:
            raise UserError(f"tensor '{name}' is listed under '{file}' but that shard at {self.folder} lacks it")
        return file, handle

    def shape(self, name: str) -> tuple[int, ...]:
        file, handle = self._holding(name)
        try:
            return tuple(handle.get_slice(name).get_shape())
        except Exception as e:
            raise UserError(f"tensor '{name}' unreadable in '{self.folder / file}' ({short_error(e)})") from None

    def stored_fp8(self, name: str) -> bool:
        """Whether the checkpoint stores `name` as float8_e4m3fn (False for a name it lacks)."""
        if not self.has(name):
            return False
        file, handle = self._holding(name)
        try:
            return handle.get_slice(name).get_dtype().upper() in _FP8_NAMES
        except Exception as e:
            raise UserError(f"tensor '{name}' unreadable in '{self.folder / file}' ({short_error(e)})") from None

    def stored_itemsize(self, name: str) -> int:
        """The bytes an element of `name` takes as stored, from the shard's header (nothing read)."""
        file, handle = self._holding(name)
        try:
            dtype = handle.get_slice(name).get_dtype().upper()
        except Exception as e:
            raise UserError(f"tensor '{name}' unreadable in '{self.folder / file}' ({short_error(e)})") from None
        if dtype not in _ITEMSIZE:
            raise UserError(f"tensor '{name}' in '{self.folder / file}' is stored as {dtype}, a dtype glm5mtp "
                            "does not handle")
        return _ITEMSIZE[dtype]

    def raw(self, name: str) -> torch.Tensor:
        """The tensor as stored (fp8 stays fp8)."""
        file, handle = self._holding(name)
        try:
            t = handle.get_tensor(name)
        except Exception as e:  # a truncated data region
            raise UserError(f"tensor '{name}' unreadable in '{self.folder / file}' ({short_error(e)})") from None
        self.bytes_read += t.numel() * t.element_size()
        return t

    def raw_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) [start, stop) of a stored tensor, read lazily: only the
        slice is copied out of the memory-mapped shard."""
        file, handle = self._holding(name)
        try:
            sl = handle.get_slice(name)
            t = sl[start:stop] if dim == 0 else sl[:, start:stop]
        except Exception as e:
            raise UserError(f"tensor '{name}' unreadable in '{self.folder / file}' ({short_error(e)})") from None
        self.bytes_read += t.numel() * t.element_size()
        return t

    def get_slice(self, name: str, dim: int, start: int, stop: int, dtype: torch.dtype | None = None,
                  device: str | torch.device = "cpu") -> torch.Tensor:
        """`get` of a slice along dim 0 or 1. FP8 weights read the whole scale blocks the slice
        touches, dequantize them and trim, so any boundary works; asked for in float8_e4m3fn, the
        stored bytes of the slice come back as they are (its scales are another get_slice)."""
        if self.stored_fp8(name) and dtype != torch.float8_e4m3fn:
            scale_name = name + "_scale_inv"
            if not self.has(scale_name):
                raise UserError(f"FP8 tensor '{name}' has no '{scale_name}' in the checkpoint at {self.folder}")
            b = self.block[dim]
            full = self.shape(name)[dim]
            s0, s1 = start // b, -(-stop // b)
            w = self.raw_slice(name, dim, s0 * b, min(s1 * b, full))
            scale = self.raw_slice(scale_name, dim, s0, s1)
            try:
                t = fp8_block_dequant_ref(w, scale, self.block, torch.float32)
            except ValueError as e:
                raise UserError(f"FP8 tensor '{name}' in '{self.file_of(name)}': {e}") from None
            t = t.narrow(dim, start - s0 * b, stop - start)
        else:
            t = self.raw_slice(name, dim, start, stop)
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        return t.to(device) if torch.device(device) != t.device else t

    def get(self, name: str, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> torch.Tensor:
        """The tensor in `dtype` on `device`; an FP8 one dequantized (fp32 `w * scale`, then `dtype`)
        unless `dtype` is float8_e4m3fn itself."""
        t = self.raw(name)
        if t.dtype == torch.float8_e4m3fn and dtype != torch.float8_e4m3fn:
            scale_name = name + "_scale_inv"
            if not self.has(scale_name):
                raise UserError(f"FP8 tensor '{name}' has no '{scale_name}' in the checkpoint at {self.folder}")
            try:
                t = fp8_block_dequant_ref(t, self.raw(scale_name), self.block, torch.float32)
            except ValueError as e:
                raise UserError(f"FP8 tensor '{name}' in '{self.file_of(name)}': {e}") from None
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        return t.to(device) if torch.device(device) != t.device else t

    def close(self) -> None:
        self._open.clear()
