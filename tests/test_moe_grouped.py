"""kernels/moe_grouped.py: the block plan, and the grouped kernels against their reference and
against kernels/moe.py's reference (Triton's interpreter in a fresh subprocess, as test_kernels.py;
compiled on a CUDA machine), and the MoE layer's choice of path."""

import json

import torch

# first: test_kernels puts the repository root on sys.path (this file also runs as a script, the
# interpreter worker, where only tests/ is on it)
from test_kernels import BF16, _moe_fp8_inputs, _moe_inputs, reference_tests, run_cases
from kernels.moe import moe_experts_fp8_ref, moe_experts_ref
from kernels.moe_grouped import (moe_experts_grouped, moe_experts_grouped_fp8, moe_experts_grouped_ref,
                                 plan_blocks)


def _skewed(args, e):
    """Routing with one crowded expert (several blocks), some empty ones, and one expert twice in a token."""
    x, gate, up, down, weights, ids = args
    ids[: ids.shape[0] // 2, 0] = 0
    ids[-1, :2] = e - 1
    return x, gate, up, down, weights, ids


def case_grouped_fp32_skewed(device, big):
    n, k, e, hid, inter = (128, 8, 32, 1000, 700) if big else (40, 2, 6, 48, 40)
    args = _skewed(_moe_inputs(device, torch.float32, n, k, e, hid, inter), e)
    return moe_experts_grouped(*args, force_triton=True), moe_experts_ref(*args)


def case_grouped_bf16_several_tiles(device, big):
    # H and I past one tile and not powers of two; int32 ids
    n, k, e, hid, inter = (16, 8, 16, 6144, 2048) if big else (70, 3, 4, 150, 136)  # big: GLM-5 dims (the reference gathers per pair)
    args = _moe_inputs(device, BF16, n, k, e, hid, inter, id_dtype=torch.int32)
    return moe_experts_grouped(*args, force_triton=True), moe_experts_ref(*args)


def case_grouped_clamped_other_ranks(device, big):
    # GLM-5-Next's clamp, activations large enough to reach it; id E marks another rank's pair
    n, k, e, hid, inter = (32, 8, 16, 4096, 1024) if big else (36, 2, 5, 64, 48)
    x, gate, up, down, weights, ids = _skewed(_moe_inputs(device, torch.float32, n, k, e, hid, inter), e)
    x = x * 8
    ids[1::3, 1] = e
    args = (x, gate, up, down, weights, ids)
    want = moe_experts_grouped_ref(*args, limit=10.0)
    assert not torch.equal(want, moe_experts_grouped_ref(*args)), "the clamp must bind in this case"
    return moe_experts_grouped(*args, limit=10.0, force_triton=True), want


def case_grouped_fp8_bf16(device, big):
    n, k, e, hid, inter = (16, 8, 16, 6144, 2048) if big else (40, 2, 4, 200, 136)
    args = list(_moe_fp8_inputs(device, BF16, n, k, e, hid, inter, 128))
    args[-1][: n // 2, 0] = 0
    return moe_experts_grouped_fp8(*args, force_triton=True), moe_experts_fp8_ref(*args)


def case_grouped_fp8_fp32_block32(device, big):
    # several 32-wide scale blocks each way: the tiles shrink to the block
    n, k, e, hid, inter, block = (128, 4, 8, 1000, 700, 32) if big else (30, 2, 3, 80, 72, 32)
    args = list(_moe_fp8_inputs(device, torch.float32, n, k, e, hid, inter, block))
    return moe_experts_grouped_fp8(*args, block=block, force_triton=True), moe_experts_fp8_ref(*args, block=block)


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}


interpreter_results, test_interpreter_matches_reference, test_cuda_matches_reference = reference_tests(__file__, CASES)


def test_plan_covers_each_pair_once_in_expert_blocks():
    torch.manual_seed(0)
    e, block = 5, 16
    ids = torch.randint(0, e + 1, (60, 3))  # E: another rank's pairs, never planned
    ids[:40, 0] = 2  # a crowded expert: three blocks
    order, expert, first, rows = plan_blocks(ids, e, block)
    flat = ids.reshape(-1)
    assert rows.numel() == min(flat.numel(), -(-flat.numel() // block) + e)
    covered = []
    for b in range(rows.numel()):
        s = list(range(int(first[b]), int(first[b]) + int(rows[b])))
        assert all(int(flat[order[i]]) == int(expert[b]) for i in s)
        covered += s
    assert sorted(int(order[i]) for i in covered) == sorted(int(i) for i in torch.nonzero(flat < e).flatten())


def test_plan_reads_nothing_on_the_host():
    """On the meta device a host read (.item(), .tolist(), bincount's max) raises: the plan can be
    captured in a CUDA graph."""
    order, expert, first, rows = plan_blocks(torch.empty(40, 8, dtype=torch.long, device="meta"), 16, 32)
    assert rows.shape == (min(320, 10 + 16),) and order.shape == (320,)


def test_reference_equals_moe_reference_and_zeroes_other_ranks():
    args = _moe_inputs("cpu", torch.float32, 6, 2, 4, 24, 16)
    assert torch.equal(moe_experts_grouped_ref(*args), moe_experts_ref(*args))
    x, gate, up, down, weights, ids = args
    theirs = ids.clone()
    theirs[:, 1] = 4
    mine_only = moe_experts_ref(x, gate, up, down, weights * torch.tensor([1.0, 0.0]), ids)
    torch.testing.assert_close(moe_experts_grouped_ref(x, gate, up, down, weights, theirs), mine_only)


if __name__ == "__main__":
    print(json.dumps(run_cases("cpu", False, CASES)))
