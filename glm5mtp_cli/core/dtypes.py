"""Element types by name, so that sizes need no torch: a torch dtype's name and its bytes per element."""

from __future__ import annotations

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "bf16": 2, "fp16": 2, "fp32": 4}


def dtype_name(dtype) -> str:
    """torch.bfloat16 -> 'bfloat16' (torch's own name, as getattr(torch, name) takes it); a name as given."""
    return str(dtype).removeprefix("torch.")


def dtype_bytes(dtype) -> int:
    """Bytes of one element of a torch dtype or a config.json dtype name (unknown names: 2)."""
    if isinstance(dtype, str):
        return _DTYPE_BYTES.get(dtype.lower(), 2)
    return dtype.itemsize
