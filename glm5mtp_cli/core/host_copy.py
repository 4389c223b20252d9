"""Host ints onto the device without a host sync: the block tables, slots and lengths a step writes."""

from __future__ import annotations

import torch


def to_device(values: list[int], device: torch.device | str) -> torch.Tensor:
    """Host ints as a long tensor on `device` without a host sync: on CUDA the copy goes through
    pinned memory asynchronously (a plain copy from pageable memory waits for the stream)."""
    t = torch.tensor(values, dtype=torch.long)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def copy_ints(dst: torch.Tensor, values) -> None:
    """dst (a long tensor) takes host ints (nested lists in its shape) without a host sync, in one
    copy: on CUDA straight from pinned memory (to_device and a copy_ would be two)."""
    src = torch.tensor(values, dtype=torch.long)
    dst.copy_(src.pin_memory() if dst.is_cuda else src, non_blocking=True)


def copy_ints_many(writes: list[tuple[torch.Tensor, list[int] | None, list[int]]]) -> None:
    """Host ints into several long tensors of one device in one host-to-device copy: for each
    (dst, rows, values), dst takes values (flat, row-major) in its shape, or with rows, its rows
    `rows` take them, in that order. Then one device copy per write: a copy_ints per table row
    (three host calls each) was a third of an admission's host time at batch 64 (H100)."""
    flat: list[int] = []
    for _, rows, values in writes:
        flat += (rows or []) + values
    if not flat:
        return
    staged = to_device(flat, writes[0][0].device)
    at = 0
    for dst, rows, values in writes:
        if rows:
            idx = staged[at:at + len(rows)]
            at += len(rows)
            dst.index_copy_(0, idx, staged[at:at + len(values)].view(len(rows), *dst.shape[1:]))
        else:
            dst.copy_(staged[at:at + len(values)].view(dst.shape))
        at += len(values)
