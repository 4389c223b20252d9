"""Pool slots of a forward's rows from its block tables (engine/cache.py, engine/static.py), as one
kernel per cache component and forward.

PyTorch's form is about a dozen launches per component (the table rows' gather, the new rows'
positions, blocks and offsets, the scratch substitution, every row's slot); a forward reads two
(GLM-5) or three (GLM-5-Next) components, every forward of a step. Here one program per sequence
and block of slots writes them.
"""

import torch

from ._triton import alloc, jit, tl, use_triton

BLOCK = 256


def table_slots_ref(table: torch.Tensor, block_size: int, starts: torch.Tensor, num_new: int,
                    scratch_block: int | None = None, idx: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of a batch's rows from block tables [*, NB] (row idx[b] is sequence b's; all rows in
    order without idx) and cached lengths starts [B], on the device.

    Returns (slots of the num_new rows each sequence appends at starts[b].. [B * num_new],
    slots of rows 0..NB*block_size-1 of each sequence [B, NB * block_size]). A new row past the
    table's capacity (padding rows of a captured forward) goes to `scratch_block` when given.
    """
    if idx is not None:
        table = table.index_select(0, idx)
    pos = starts[:, None] + torch.arange(num_new, device=table.device)
    nb = table.shape[1]
    block = pos // block_size
    new = table.gather(1, block.clamp(max=nb - 1)) * block_size + pos % block_size
    if scratch_block is not None:
        new = torch.where(block < nb, new, scratch_block * block_size + pos % block_size)
    rows = table[:, :, None] * block_size + torch.arange(block_size, device=table.device)  # [B, NB, bs]
    return new.reshape(-1), rows.reshape(table.shape[0], -1)


@jit
def _table_slots_kernel(table_ptr, idx_ptr, starts_ptr, new_ptr, rows_ptr, NB, BS, T, ROW_PROGRAMS, SCRATCH,
                        HAS_IDX: tl.constexpr, HAS_SCRATCH: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    if HAS_IDX:
        entries = table_ptr + tl.load(idx_ptr + b).to(tl.int64) * NB
    else:
        entries = table_ptr + b * NB
    if j < ROW_PROGRAMS:  # every row of the table: rows[b, r]
        r = j * BLOCK + tl.arange(0, BLOCK)
        rm = r < NB * BS
        blk = tl.load(entries + r // BS, mask=rm, other=0)
        tl.store(rows_ptr + b * NB * BS + r, blk * BS + r % BS, mask=rm)
    else:  # the new rows: new[b * T + i]
        i = (j - ROW_PROGRAMS) * BLOCK + tl.arange(0, BLOCK)
        im = i < T
        pos = tl.load(starts_ptr + b) + i
        blk_no = pos // BS
        slot = tl.load(entries + tl.minimum(blk_no, NB - 1), mask=im, other=0) * BS + pos % BS
        if HAS_SCRATCH:
            slot = tl.where(blk_no < NB, slot, SCRATCH * BS + pos % BS)
        tl.store(new_ptr + b * T + i, slot, mask=im)


def table_slots_triton(table, block_size, starts, num_new, scratch_block=None, idx=None):
    b = idx.shape[0] if idx is not None else table.shape[0]
    nb = table.shape[1]
    new = alloc((b * num_new,), table.dtype, table.device)
    rows = alloc((b, nb * block_size), table.dtype, table.device)
    row_programs = -(-nb * block_size // BLOCK)
    if b:
        _table_slots_kernel[(b, row_programs + -(-num_new // BLOCK))](
            table.contiguous(), idx if idx is not None else starts, starts.contiguous(), new, rows, nb, block_size,
            num_new, row_programs, scratch_block if scratch_block is not None else 0,
            HAS_IDX=idx is not None, HAS_SCRATCH=scratch_block is not None, BLOCK=BLOCK)
    return new, rows


def table_slots(table, block_size: int, starts, num_new: int, scratch_block: int | None = None, idx=None,
                force_triton: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """table_slots_ref's results; the Triton kernel for CUDA tensors (or `force_triton` in the
    interpreter). Compiled forwards trace the reference: inductor fuses its index arithmetic."""
    if not torch.compiler.is_compiling() and use_triton(table, starts, force=force_triton):
        return table_slots_triton(table, block_size, starts, num_new, scratch_block, idx)
    return table_slots_ref(table, block_size, starts, num_new, scratch_block, idx)
