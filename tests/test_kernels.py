"""Each Triton kernel against its PyTorch reference (the references' own semantics: test_kernel_refs.py).

Triton's interpreter must be switched on (``TRITON_INTERPRET=1``) before the process first
imports ``triton``: its standard library is decorated at import. Another test module may already
have imported it, so the interpreter comparisons run in a fresh subprocess: this file, executed
as a script, runs every case in ``CASES`` and prints one JSON line of results that the
``test_interpreter_*`` tests read. On a CUDA machine the same cases also run in-process, compiled,
at larger shapes. Outputs are NaN-poisoned before every launch (``KERNELS_POISON_OUTPUTS``), so
an element a kernel never writes fails the comparison.
"""

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kernels import _triton  # noqa: E402
from kernels.bitmask import apply_bitmask, apply_bitmask_ref  # noqa: E402
from kernels.fp8_block import (fp8_block_dequant, fp8_block_dequant_ref, fp8_block_matmul,  # noqa: E402
                               fp8_block_matmul_ref, fp8_block_matmul_triton, fp8_heads_matmul, fp8_heads_matmul_ref)
from kernels.moe import moe_experts, moe_experts_fp8, moe_experts_fp8_ref, moe_experts_ref  # noqa: E402
from kernels.paged import (indexer_scores_paged, indexer_scores_paged_ref, mla_attention_paged,  # noqa: E402
                           mla_attention_paged_ref)
from kernels.rmsnorm import rmsnorm, rmsnorm_pair, rmsnorm_pair_ref, rmsnorm_ref  # noqa: E402
from kernels.rope import rope_interleaved, rope_interleaved_ref  # noqa: E402
from kernels.router import route, route_ref  # noqa: E402
from kernels.swiglu import swiglu, swiglu_ref  # noqa: E402
from kernels.table_slots import table_slots, table_slots_ref  # noqa: E402

BF16 = torch.bfloat16


# ----------------------------------------------------------------------------------------------
# Cases: each builds fresh random inputs on `device` at small (interpreter) or big (GPU) shapes and
# returns (got, want) or (got, want, relative tolerance), got from the Triton path.


def _rand(*shape, device, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def _fp8(n, k, device, block=128):
    w = _rand(n, k, device=device, scale=40.0).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand((n + block - 1) // block, (k + block - 1) // block, device=device) * 0.02 + 0.001
    return w, s


def case_rmsnorm(device, big):
    shape = (8, 6144) if big else (2, 3, 96)
    x, w = _rand(*shape, device=device), _rand(shape[-1], device=device)
    return rmsnorm(x, w, 1e-5, force_triton=True), rmsnorm_ref(x, w, 1e-5)


def case_rmsnorm_bf16_residual(device, big):
    shape = (8, 6144) if big else (5, 200)
    x, r = _rand(*shape, device=device, dtype=BF16), _rand(*shape, device=device, dtype=BF16)
    w = _rand(shape[-1], device=device, dtype=BF16)
    return rmsnorm(x, w, 1e-5, r, force_triton=True), rmsnorm_ref(x, w, 1e-5, r)


def case_rmsnorm_strided_fp32_weight(device, big):
    # the latent slice of a fused [latent | rope] projection, normalised in place of a copy
    lat, rope = (512, 64) if big else (40, 16)
    fused = _rand(7, lat + rope, device=device, dtype=BF16)
    x, w = fused[:, :lat], _rand(lat, device=device)
    # fp32 output, but the normalised value is rounded to bf16 before the weight: bf16 tolerance
    return rmsnorm(x, w, 1e-6, force_triton=True), rmsnorm_ref(x, w, 1e-6), 1e-2


def case_rmsnorm_pair_bf16(device, big):
    # an MTP layer's input: a [B, T, D] embedding beside a strided hidden, bf16 weights
    b, t, d = (8, 4, 6144) if big else (2, 3, 48)
    e, h = _rand(b, t, d, device=device, dtype=BF16), _rand(b, t, 2 * d, device=device, dtype=BF16)[..., d:]
    we, wh = _rand(d, device=device, dtype=BF16), _rand(d, device=device, dtype=BF16)
    return rmsnorm_pair(e, we, h, wh, 1e-5, force_triton=True), rmsnorm_pair_ref(e, we, h, wh, 1e-5)


def case_rope_3d(device, big):
    t, h, d = (8, 64, 64) if big else (3, 5, 12)
    x = _rand(t, h, d, device=device)
    cos, sin = _rand(t, d // 2, device=device), _rand(t, d // 2, device=device)
    return rope_interleaved(x, cos, sin, force_triton=True), rope_interleaved_ref(x, cos, sin)


def case_rope_2d_bf16(device, big):
    t, d = (8, 64) if big else (4, 10)
    x = _rand(t, d, device=device, dtype=BF16)
    cos, sin = _rand(t, d // 2, device=device), _rand(t, d // 2, device=device)
    return rope_interleaved(x, cos, sin, force_triton=True), rope_interleaved_ref(x, cos, sin)


def case_rope_strided_slice(device, big):
    t, h, nope, d = (8, 64, 192, 64) if big else (3, 20, 6, 8)  # q[..., nope:] as the model slices it
    q = _rand(t, h, nope + d, device=device, dtype=BF16)
    cos, sin = _rand(t, d // 2, device=device), _rand(t, d // 2, device=device)
    x = q[..., nope:]
    return rope_interleaved(x, cos, sin, force_triton=True), rope_interleaved_ref(x, cos, sin)


def case_fp8_dequant(device, big):
    m, n = (2100, 6100) if big else (200, 150)
    w, s = _fp8(m, n, device)
    return (fp8_block_dequant(w, s, 128, torch.float32, force_triton=True),
            fp8_block_dequant_ref(w, s, 128, torch.float32))


def case_fp8_dequant_bf16_block32(device, big):
    m, n = (1000, 700) if big else (70, 45)
    w, s = _fp8(m, n, device, block=32)
    return fp8_block_dequant(w, s, 32, BF16, force_triton=True), fp8_block_dequant_ref(w, s, 32, BF16)


def case_fp8_all_codes(device, big):
    # every float8_e4m3fn code except the two NaNs (the interpreter reads those as 480)
    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8).to(device)
    w = torch.cat([codes, codes[:2]]).view(torch.float8_e4m3fn).reshape(2, 128)
    s = torch.ones(1, 1, device=device)
    return (fp8_block_dequant(w, s, 128, torch.float32, force_triton=True),
            fp8_block_dequant_ref(w, s, 128, torch.float32))


def case_fp8_matmul_fp32(device, big):
    t, n, k = (8, 2100, 6144) if big else (5, 200, 300)
    x = _rand(t, k, device=device)
    w, s = _fp8(n, k, device)
    return fp8_block_matmul(x, w, s, force_triton=True), fp8_block_matmul_ref(x, w, s)


def case_fp8_matmul_bf16(device, big):
    lead, n, k = ((3, 40), 6144, 2048) if big else ((2, 3), 70, 130)
    x = _rand(*lead, k, device=device, dtype=BF16)
    w, s = _fp8(n, k, device)
    return fp8_block_matmul(x, w, s, force_triton=True), fp8_block_matmul_ref(x, w, s)


def case_fp8_matmul_no_split(device, big):
    t, n, k = (8, 4096, 4096) if big else (3, 130, 260)
    x = _rand(t, k, device=device, dtype=BF16)
    w, s = _fp8(n, k, device)
    return fp8_block_matmul_triton(x, w, s, split_k=1), fp8_block_matmul_ref(x, w, s)


def case_fp8_matmul_decode_row(device, big):
    # one row (a draft step): glm5-nano's kv_a_proj (384 -> 160: 3 splits); big: GLM-5's (6144 -> 576)
    n, k = (576, 6144) if big else (160, 384)
    x, (w, s) = _rand(1, k, device=device, dtype=BF16), _fp8(n, k, device)
    return fp8_block_matmul(x, w, s, force_triton=True), fp8_block_matmul_ref(x, w, s)


def case_fp8_matmul_uneven_splits(device, big):
    # split-K whose last split has fewer K tiles (3 tiles in splits of 2; big: 48 in splits of 10)
    t, n, k, split = (2, 6144, 6144, 10) if big else (2, 100, 384, 2)
    x, (w, s) = _rand(t, k, device=device), _fp8(n, k, device)
    return fp8_block_matmul_triton(x, w, s, split_k=split), fp8_block_matmul_ref(x, w, s)


def case_fp8_matmul_launch_override(device, big):
    # the sweep's launch (kernels/sweep_fp8.py): programs, BLOCK_N, stages other than the tuned ones
    n, k = (2048, 6144) if big else (160, 384)
    x, (w, s) = _rand(1, k, device=device, dtype=BF16), _fp8(n, k, device)
    return fp8_block_matmul_triton(x, w, s, launch=(264, 64, 3)), fp8_block_matmul_ref(x, w, s)


def _kv_b_cases(device, big, dtype, t):  # MLA's kv_b, absorb and value; glm5-nano's: heads straddle scale blocks
    heads, nope, v, c = (64, 192, 256, 512) if big else (6, 32, 64, 128)
    w, s = _fp8(heads * (nope + v), c, device)
    args = [(_rand(t, heads, nope, device=device, dtype=dtype), w, s, heads, 0, nope, True),
            (_rand(t, heads, c, device=device, dtype=dtype), w, s, heads, nope, v, False)]
    return tuple(fp8_heads_matmul(*a, force_triton=True) for a in args), tuple(fp8_heads_matmul_ref(*a) for a in args)


def case_fp8_heads_fp32(device, big):
    return _kv_b_cases(device, big, torch.float32, 20)


def case_fp8_heads_bf16_one_row(device, big):  # big: GLM-5's dims
    return _kv_b_cases(device, big, BF16, 1)


def case_fp8_matmul_prefill_bf16(device, big):
    t, n, k = (300, 2048, 6144) if big else (40, 64, 256)  # several row tiles
    x = _rand(t, k, device=device, dtype=BF16)
    w, s = _fp8(n, k, device)
    return fp8_block_matmul(x, w, s, force_triton=True), fp8_block_matmul_ref(x, w, s)


def _moe_inputs(device, dtype, n, k, e, hid, inter, id_dtype=torch.int64):
    """x, gate, up, down, weights, ids with O(1) activations; expert e-1 (the last) picked twice."""
    x = _rand(n, hid, device=device, dtype=dtype)
    gate = _rand(e, inter, hid, device=device, dtype=dtype, scale=hid ** -0.5)
    up = _rand(e, inter, hid, device=device, dtype=dtype, scale=hid ** -0.5)
    down = _rand(e, hid, inter, device=device, dtype=dtype, scale=inter ** -0.5)
    ids = torch.stack([torch.randperm(e, device=device)[:k] for _ in range(n)])
    ids[0, 0] = e - 1
    if n > 1:
        ids[1, -1] = e - 1  # the same expert for a second token
    weights = torch.rand(n, k, device=device) + 0.1
    return x, gate, up, down, weights / weights.sum(-1, keepdim=True), ids.to(id_dtype)


def case_moe_fp32(device, big):
    n, k, e, hid, inter = (3, 4, 8, 1000, 700) if big else (3, 2, 5, 48, 40)
    args = _moe_inputs(device, torch.float32, n, k, e, hid, inter)
    args[-1][2, :2] = 1  # one expert twice in a token
    return moe_experts(*args, force_triton=True), moe_experts_ref(*args)


def case_moe_bf16(device, big):
    n, k, e, hid, inter = (4, 8, 16, 6144, 2048) if big else (3, 2, 5, 48, 40)  # big: GLM-5's dims
    args = _moe_inputs(device, BF16, n, k, e, hid, inter)
    args[-1][2, :2] = 3  # one expert twice in a token
    return moe_experts(*args, force_triton=True), moe_experts_ref(*args)


def case_moe_bf16_several_tiles_int32_ids(device, big):
    # H and I past one 256-wide tile, neither a power of two; int32 ids; one token (a decode step)
    n, k, e, hid, inter = (1, 8, 12, 6144, 2048) if big else (2, 3, 4, 300, 272)
    args = _moe_inputs(device, BF16, n, k, e, hid, inter, id_dtype=torch.int32)
    return moe_experts(*args, force_triton=True), moe_experts_ref(*args)


def _moe_fp8_inputs(device, dtype, n, k, e, hid, inter, block):
    """x, FP8 stacks with their scale grids, weights, ids (as _moe_inputs, weights quantized per block)."""
    x, gate, up, down, weights, ids = _moe_inputs(device, torch.float32, n, k, e, hid, inter)
    stacks = []
    for w in (gate, up, down):
        rows, cols = w.shape[1:]
        s = torch.rand(e, -(-rows // block), -(-cols // block), device=device) * 0.02 + 0.001
        q = (w / _expand(s, rows, cols, block)).clamp(-448, 448).to(torch.float8_e4m3fn)
        stacks += [q, s]
    return (x.to(dtype), *stacks, weights, ids)


def _expand(s, rows, cols, block):
    return s.repeat_interleave(block, -2)[..., :rows, :].repeat_interleave(block, -1)[..., :cols]


def case_moe_fp8_fp32_block32(device, big):
    # several scale blocks per expert matrix (both directions) at small sizes; one expert twice in a token
    n, k, e, hid, inter, block = (3, 4, 8, 1000, 700, 128) if big else (3, 2, 5, 80, 72, 32)
    args = _moe_fp8_inputs(device, torch.float32, n, k, e, hid, inter, block)
    args[-1][2, :2] = 1
    return (moe_experts_fp8(*args, block=block, force_triton=True), moe_experts_fp8_ref(*args, block=block))


def case_moe_fp8_bf16_partial_blocks(device, big):
    # H and I not multiples of the 128 block, past one 256-wide tile; big: GLM-5's dims, one token
    n, k, e, hid, inter = (1, 8, 12, 6144, 2048) if big else (2, 3, 4, 300, 272)
    args = _moe_fp8_inputs(device, BF16, n, k, e, hid, inter, 128)
    return moe_experts_fp8(*args, force_triton=True), moe_experts_fp8_ref(*args)


def case_moe_bf16_clamped(device, big):
    # GLM-5-Next's swiglu clamp (10): activations large enough that most gate/up products pass it
    n, k, e, hid, inter = (4, 8, 16, 4096, 2048) if big else (3, 2, 5, 48, 40)
    x, *rest = _moe_inputs(device, BF16, n, k, e, hid, inter)
    args = ((x.float() * 30).to(BF16), *rest)
    return moe_experts(*args, swiglu_limit=10.0, force_triton=True), moe_experts_ref(*args, swiglu_limit=10.0)


def case_moe_fp8_fp32_clamped_block32(device, big):
    n, k, e, hid, inter, block = (1, 8, 12, 4096, 2048, 128) if big else (3, 2, 5, 80, 72, 32)
    x, *rest = _moe_fp8_inputs(device, torch.float32, n, k, e, hid, inter, block)
    args = (x * 30, *rest)
    return (moe_experts_fp8(*args, block=block, swiglu_limit=10.0, force_triton=True),
            moe_experts_fp8_ref(*args, block=block, swiglu_limit=10.0))


def _bitmask(rows, vocab, device):
    """Random int32 words for [*rows, vocab] logits, one row all banned and one all allowed."""
    from kernels.bitmask import words

    mask = torch.randint(-(2 ** 31), 2 ** 31 - 1, (*rows, words(vocab)), dtype=torch.int32, device=device)
    mask.view(-1, mask.shape[-1])[0] = 0
    mask.view(-1, mask.shape[-1])[-1] = -1
    return mask


def case_bitmask_verify_rows_fp32(device, big):
    # [A, g + 1, V] verify logits, V not a multiple of 32 (the last word half used)
    a, g, v = (8, 4, 154880 + 7) if big else (3, 4, 1000)
    logits, mask = _rand(a, g, v, device=device), _bitmask((a, g), v, device)
    return apply_bitmask(logits.clone(), mask, force_triton=True), apply_bitmask_ref(logits.clone(), mask)


def case_bitmask_draft_rows_bf16(device, big):
    a, v = (64, 154880) if big else (5, 2048)
    logits, mask = _rand(a, v, device=device, dtype=BF16), _bitmask((a,), v, device)
    return apply_bitmask(logits.clone(), mask, force_triton=True), apply_bitmask_ref(logits.clone(), mask)


def _route(device, n, e, k, groups, topk_group):
    """The router's choice is a set: both sides' ids sorted, their weights in that order."""
    logits, bias = _rand(n, e, device=device, scale=3.0), _rand(e, device=device, scale=0.5)
    out = []
    for w, ids in (route(logits, bias, k, groups, topk_group, True, 2.5, force_triton=True),
                   route_ref(logits, bias, k, groups, topk_group, True, 2.5)):
        order = ids.argsort(-1)
        out.append((w.gather(1, order), ids.gather(1, order).float()))
    return tuple(out)


def case_route(device, big):
    # GLM-5's and GLM-5-Next's routers: no groups, E not a power of two in the small case
    return _route(device, 64 if big else 5, 256 if big else 12, 8 if big else 3, 1, 1)


def case_route_groups(device, big):
    # glm5-nano's: 2 groups, the best one kept
    return _route(device, 64 if big else 5, 16, 2, 2, 1)


def case_route_groups_many(device, big):
    # more groups than kept, several kept: DeepSeek-V3's 8 groups, 4 kept
    return _route(device, 64 if big else 4, 256 if big else 32, 8 if big else 4, 8, 4)


def case_swiglu_joined_bf16_limit(device, big):
    # GLM-5-Next's clamped form on the two halves of a joined gate-up projection (strided rows),
    # values past the limit on both sides; more columns than one program's block when big
    n, inner = (8, 2048) if big else (3, 40)
    gate_up = _rand(n, 2 * inner, device=device, dtype=BF16, scale=8.0)
    gate, up = gate_up[:, :inner], gate_up[:, inner:]
    return swiglu(gate, up, 10.0, force_triton=True), swiglu_ref(gate, up, 10.0)


def case_swiglu_fp32(device, big):
    # GLM-5's form: no clamp
    x = _rand(2, 3, 1536 if big else 24, device=device, scale=4.0)
    return swiglu(x, x.flip(-1), force_triton=True), swiglu_ref(x, x.flip(-1))


def _table_slots(device, *args, **kwargs):
    """Slots are exact: compared here, returned as floats for check_close."""
    got, want = table_slots(*args, **kwargs, force_triton=True), table_slots_ref(*args, **kwargs)
    assert all(torch.equal(g, w) for g, w in zip(got, want)), "slots differ"
    return tuple(g.float() for g in got), tuple(w.float() for w in want)


def case_table_slots_captured(device, big):
    # a captured verify's rows: table rows picked by idx (the last: all scratch), new rows past a
    # table's capacity to the scratch block, the table's rows over more than one program
    slots, nb, bs, t = (65, 40, 64, 4) if big else (5, 9, 32, 4)
    table = torch.randint(0, 1000, (slots + 1, nb), device=device)
    table[-1] = 999
    idx = torch.tensor([3, 0, slots, 1, 2], device=device)
    starts = torch.tensor([0, nb * bs - 2, 17, nb * bs, 5], device=device)
    return _table_slots(device, table, bs, starts, t, 999, idx)


def case_table_slots_prefill(device, big):
    # an eager prefill: the tables as they are, more new rows than a program's block
    b, nb, bs, t = (8, 33, 64, 700) if big else (3, 12, 32, 300)
    table = torch.randint(0, 5000, (b, nb), device=device)
    starts = torch.tensor([0, 1, 50, 3, 0, 9, 64, 2][:b], device=device)
    return _table_slots(device, table, bs, starts, t)


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}


def check_close(got, want, rel=None) -> None:
    """Assert got == want within `rel` (default: by output dtype); NaN (unwritten) always fails."""
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want)
        for g, w in zip(got, want):
            check_close(g, w, rel)
        return
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    assert not got.isnan().any(), "NaN in the output (an element left unwritten?)"
    finite = want.float()[torch.isfinite(want)]
    peak = finite.abs().max().item() if finite.numel() else 1.0
    # bf16: one or two ulps (the interpreter truncates fp32 -> bf16); fp32: 1e-5 (1e-4 compiled)
    if rel is None:
        rel = 1e-2 if want.dtype == BF16 else (1e-5 if not got.is_cuda else 1e-4)
    torch.testing.assert_close(got.float(), want.float(), rtol=rel, atol=rel * peak)


# Triton 3.6's interpreter turns a runtime loop bound into an int with `int(array_of_shape_(1,))`,
# which NumPy >= 2.4 refuses (TypeError "only 0-dimensional arrays ..."); triton 3.9 squeezes
# first. Kernels with such loops cannot run in that interpreter: those cases are skipped there
# (on such a machine the compiled CUDA cases still cover them).
_OLD_INTERPRETER_ERROR = "only 0-dimensional arrays can be converted to Python scalars"


def run_cases(device: str, big: bool, cases: dict | None = None) -> dict:
    """Each case's verdict (cases: default this file's CASES; test_moe_grouped.py brings its own)."""
    results = {}
    for name, fn in (CASES if cases is None else cases).items():
        torch.manual_seed(zlib.crc32(name.encode()))
        try:
            check_close(*fn(device, big))
            results[name] = "ok"
        except Exception as exc:  # reported, per case, to the parent test
            results[name] = f"{type(exc).__name__}: {exc}"
            if device == "cpu" and _OLD_INTERPRETER_ERROR in str(exc):
                results[name] = "skip: this triton's interpreter cannot run runtime loop bounds with this NumPy"
    return results


# ----------------------------------------------------------------------------------------------
# Triton vs reference


def interpret(script: str) -> dict:
    """Run `script` (a test file whose __main__ prints run_cases' JSON) in a fresh interpreter-mode
    process; its per-case verdicts."""
    if not _triton.HAVE_TRITON:
        pytest.skip("triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1", KERNELS_POISON_OUTPUTS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def reference_tests(script: str, cases: dict):
    """A case file's tests (this file's, test_kernels_next.py's, ...): its cases in Triton's
    interpreter (`script` run in a fresh process, run_cases' verdicts) and, on a CUDA machine,
    compiled at their large shapes. -> (the interpreter_results fixture, the two tests), to bind at
    module level under those names."""

    @pytest.fixture(scope="module")
    def interpreter_results():
        return interpret(script)

    @pytest.mark.parametrize("name", sorted(cases))
    def test_interpreter_matches_reference(interpreter_results, name):
        if interpreter_results[name].startswith("skip: "):
            pytest.skip(interpreter_results[name][len("skip: "):])
        assert interpreter_results[name] == "ok", interpreter_results[name]

    @pytest.mark.skipif(not (torch.cuda.is_available() and _triton.HAVE_TRITON), reason="needs CUDA and triton")
    @pytest.mark.parametrize("name", sorted(cases))
    def test_cuda_matches_reference(monkeypatch, name):
        monkeypatch.setattr(_triton, "POISON_OUTPUTS", True)
        torch.manual_seed(0)
        check_close(*cases[name]("cuda", True))

    return interpreter_results, test_interpreter_matches_reference, test_cuda_matches_reference


interpreter_results, test_interpreter_matches_reference, test_cuda_matches_reference = reference_tests(__file__, CASES)


# ----------------------------------------------------------------------------------------------
# Dispatch and packaging


def test_dispatch_picks_reference_on_cpu(monkeypatch):
    import kernels.fp8_block as f
    import kernels.moe as e
    import kernels.paged as pg
    import kernels.rmsnorm as r
    import kernels.rope as p
    import kernels.router as rr
    import kernels.table_slots as ts

    def boom(*args, **kwargs):
        raise AssertionError("Triton path taken for CPU tensors")

    for mod, name in [(r, "rmsnorm_triton"), (p, "rope_interleaved_triton"), (f, "fp8_block_dequant_triton"),
                      (f, "fp8_block_matmul_triton"), (e, "moe_experts_triton"),
                      (pg, "indexer_scores_paged_triton"), (pg, "mla_attention_paged_triton"),
                      (ts, "table_slots_triton"), (rr, "route_triton")]:
        monkeypatch.setattr(mod, name, boom)
    x, w = torch.randn(3, 16), torch.randn(16)
    assert torch.equal(rmsnorm(x, w, 1e-5), rmsnorm_ref(x, w, 1e-5))
    cs = torch.randn(3, 8)
    assert torch.equal(rope_interleaved(x, cs, cs), rope_interleaved_ref(x, cs, cs))
    wq, s = _fp8(16, 16, "cpu")
    assert torch.equal(fp8_block_dequant(wq, s), fp8_block_dequant_ref(wq, s))
    assert torch.equal(fp8_block_matmul(x, wq, s), fp8_block_matmul_ref(x, wq, s))
    from test_kernels_paged import _seq_mla  # here: that module imports this one

    qn, qr, kv = torch.randn(2, 4, 8), torch.randn(2, 4, 4), torch.randn(6, 12)
    assert torch.equal(_seq_mla(mla_attention_paged, qn, qr, kv, None, 4, 0.3),
                       _seq_mla(mla_attention_paged_ref, qn, qr, kv, None, 4, 0.3))
    me = _moe_inputs("cpu", torch.float32, 2, 2, 3, 16, 8)
    assert torch.equal(moe_experts(*me), moe_experts_ref(*me))
    pool, slots, st = torch.randn(9, 12), torch.tensor([[3, 1, 4, 0]]), torch.tensor([2])
    pq, pw = torch.randn(1, 2, 3, 12), torch.randn(1, 2, 3)
    assert torch.equal(indexer_scores_paged(pq, pool, slots, st, pw, 0.5),
                       indexer_scores_paged_ref(pq, pool, slots, st, pw, 0.5))
    assert torch.equal(mla_attention_paged(qn[None, :2], qr[None, :2], kv, slots, st, None, 0.3),
                       mla_attention_paged_ref(qn[None, :2], qr[None, :2], kv, slots, st, None, 0.3))
    logits, bias = torch.randn(3, 16), torch.randn(16)
    assert all(torch.equal(a, b) for a, b in zip(route(logits, bias, 2, 2, 1, True, 2.5),
                                                  route_ref(logits, bias, 2, 2, 1, True, 2.5)))
    table = torch.tensor([[2, 0], [1, 3]])
    assert all(torch.equal(a, b) for a, b in zip(table_slots(table, 4, torch.tensor([1, 6]), 2, 9, torch.tensor([1, 0])),
                                                  table_slots_ref(table, 4, torch.tensor([1, 6]), 2, 9, torch.tensor([1, 0]))))


def test_force_triton_without_interpreter_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="force_triton"):
        rmsnorm(torch.randn(2, 8), torch.randn(8), 1e-5, force_triton=True)


def test_kernels_import_without_triton():
    code = ("import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
            "import torch, kernels\n"
            "from kernels.rmsnorm import rmsnorm\n"
            "from kernels.paged import mla_attention_paged\n"
            "import kernels.fp8_block, kernels.moe, kernels.rope\n"
            "assert kernels.HAVE_TRITON is False and not hasattr(kernels, '__version__')\n"
            "print(rmsnorm(torch.ones(2, 4), torch.ones(4), 1e-5).sum().item())\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert abs(float(proc.stdout.strip()) - 8.0) < 1e-3


def test_poisoned_alloc_is_nan(monkeypatch):
    monkeypatch.setattr(_triton, "POISON_OUTPUTS", True)
    assert _triton.alloc((3, 5), torch.bfloat16, "cpu").isnan().all()


if __name__ == "__main__":  # the interpreter worker (see the module docstring)
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through the tests, or set TRITON_INTERPRET=1"
    print(json.dumps(run_cases("cpu", big=False)))
