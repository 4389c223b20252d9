"""GLM-5-Next's kernels against their references: mHC's mixing weights, collapse and expand
(kernels/mhc.py), KDA's short conv (kernels/short_conv.py), recurrence (kernels/kda.py) and output
gate (kernels/rmsnorm.gated_rmsnorm), the pooled indexer's keys (kernels/pool_keys.py), in Triton's interpreter in a fresh subprocess
and compiled on CUDA, as tests/test_kernels.py runs the others (its module docstring)."""

import json
import sys
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from kernels import mhc  # noqa: E402
from kernels.kda import kda_rows, kda_rows_ref, kda_slots, kda_slots_ref  # noqa: E402
from kernels.rmsnorm import gated_rmsnorm, gated_rmsnorm_ref  # noqa: E402
from kernels.pool_keys import write_pool_keys, write_pool_keys_ref  # noqa: E402
from kernels.short_conv import short_conv, short_conv_ref  # noqa: E402
from kernels.mhc import (hc_collapse, hc_collapse_norm, hc_collapse_norm_ref, hc_collapse_ref, hc_expand, hc_expand_ref, hc_mix_ref, hc_weights,  # noqa: E402
                         hc_weights_ref)
from test_kernels import BF16, _rand, reference_tests, run_cases  # noqa: E402


def _hc_weights(device, t, n=4):
    m = _rand(t, (2 + n) * n, device=device, scale=2.0)
    base, scale = _rand((2 + n) * n, device=device), torch.rand(3, device=device) + 0.5
    return m, base, scale


def _hc_site(device, t, d, dtype, n=4):
    streams = _rand(t, n, d, device=device, dtype=dtype)
    fn = _rand((2 + n) * n, n * d, device=device, scale=(n * d) ** -0.5 * 3)
    _, base, scale = _hc_weights(device, 1, n)
    return streams, fn, base, scale


def case_hc_weights(device, big):
    # GLM-5-Next's n = 4 and 20 Sinkhorn iterations; rows past a program's block are masked, and the
    # columns split over programs end inside a block (D = 200: 800 columns)
    args = _hc_site(device, 300 if big else 21, 6144 if big else 200, torch.float32)
    return hc_weights(*args, 1e-5, 1e-6, 20, force_triton=True), hc_weights_ref(*args, 1e-5, 1e-6, 20)


def case_hc_weights_decode_bf16(device, big):
    # one row (a decode at batch 1): every program of the logits a column split of it, the mix summing
    # them a block of splits a load (on a 132-SM GPU 192 splits, six blocks of 32; in the interpreter,
    # with its 8 "SMs", 13 in blocks of 4, the last part-filled, as case_hc_weights' 14 are on the GPU)
    args = _hc_site(device, 1, 6144 if big else 200, BF16)
    with mock.patch.object(mhc, "MIX_BLOCK_S", mhc.MIX_BLOCK_S if big else 4):
        return hc_weights(*args, 1e-5, 1e-6, 20, force_triton=True), hc_weights_ref(*args, 1e-5, 1e-6, 20)


def _hc_streams(device, big, dtype):
    t, d = (8, 6144) if big else (3, 40)  # d not a power of two: the last block is masked
    pre, post, comb = hc_mix_ref(*_hc_weights(device, t), 1e-6, 20)
    return _rand(t, 4, d, device=device, dtype=dtype), _rand(t, d, device=device, dtype=dtype), pre, post, comb


def case_hc_collapse(device, big):
    x, _, pre, _, _ = _hc_streams(device, big, torch.float32)
    return hc_collapse(x, pre, force_triton=True), hc_collapse_ref(x, pre)


def case_hc_collapse_norm_bf16(device, big):
    # the block's normed input; D = 6144 takes the row in six blocks, 40 ends inside one
    x, _, pre, _, _ = _hc_streams(device, big, BF16)
    w = _rand(x.shape[-1], device=device, dtype=BF16) + 1
    return hc_collapse_norm(x, pre, w, 1e-5, force_triton=True), hc_collapse_norm_ref(x, pre, w, 1e-5)


def case_hc_expand(device, big):
    x, y, _, post, comb = _hc_streams(device, big, torch.float32)
    return hc_expand(x, y, post, comb, force_triton=True), hc_expand_ref(x, y, post, comb)


def case_hc_collapse_expand_bf16(device, big):
    x, y, pre, post, comb = _hc_streams(device, big, BF16)
    return ((hc_collapse(x, pre, force_triton=True), hc_expand(x, y, post, comb, force_triton=True)),
            (hc_collapse_ref(x, pre), hc_expand_ref(x, y, post, comb)))


def _conv_inputs(device, big, dtype, t):
    b, c = (8, 3 * 512) if big else (3, 3 * 40)
    # the rows a strided slice of a joined projection (their GEMM's other outputs beside them)
    z = _rand(b, t, c + 24, device=device, dtype=dtype)[..., :c]
    window = _rand(b, 3, c, device=device, dtype=dtype)
    return z, window, _rand(c, 4, device=device, scale=0.5)


def case_short_conv_decode(device, big):
    args = _conv_inputs(device, big, BF16, 1)
    return short_conv(*args, force_triton=True), short_conv_ref(*args)


def case_short_conv_rows(device, big):
    # a verify's rows and a prefill's (more rows than the window, and than a program's 16: the last
    # row block part-filled), fp32: the window's zeros at a start
    z, window, w = _conv_inputs(device, big, torch.float32, 37 if big else 21)
    window[0] = 0
    return short_conv(z, window, w, force_triton=True), short_conv_ref(z, window, w)


def case_gated_rmsnorm(device, big):
    # the recurrence's fp32 outputs, rounded to the model dtype first; the gate a GEMM's bf16 rows
    rows, h, d = (64, 32, 128) if big else (5, 4, 64)
    o = _rand(2, rows, h, d, device=device)
    gate = _rand(2, rows, h * d, device=device, dtype=BF16)
    w = _rand(d, device=device) + 1
    return gated_rmsnorm(o, gate, w, 1e-5, BF16, force_triton=True), gated_rmsnorm_ref(o, gate, w, 1e-5, BF16)


def case_gated_rmsnorm_fp32(device, big):
    o, gate, w = _rand(3, 4, 64, device=device), _rand(3, 256, device=device), _rand(64, device=device)
    f32 = torch.float32
    return gated_rmsnorm(o, gate, w, 1e-5, f32, force_triton=True), gated_rmsnorm_ref(o, gate, w, 1e-5, f32)


def _kda_rows_inputs(device, big):
    from glm5mtp_cli.models.glm5_next.kda import prepare_inputs

    t, n, d = (5, 64, 128) if big else (4, 6, 16)  # a gamma-4 verify; big: 8 sequences x 8 heads, Flash's head size
    x = prepare_inputs(*(_rand(t, n, d, device=device) for _ in range(3)), -torch.rand(t, n, d, device=device) * 2,
                       torch.rand(t, n, device=device))
    return (x.q, x.k, x.v, x.g, x.beta, _rand(n, d, d, device=device, scale=0.1)), t, n


def case_kda_rows(device, big):
    args, _, _ = _kda_rows_inputs(device, big)
    return kda_rows(*args, force_triton=True), kda_rows_ref(*args)


def case_kda_rows_lengths(device, big):
    # the commit's replay: each head keeps its own prefix, 0 to all rows
    args, t, n = _kda_rows_inputs(device, big)
    lengths = torch.arange(n, device=device) % (t + 1)
    return kda_rows(*args, lengths, force_triton=True), kda_rows_ref(*args, lengths)


def _kda_slots_inputs(device, big, layers=1, rows=None):
    """A KDA layer's raw rows as the model passes them: q, k, v chunks of one conv output (strided
    views), bf16 at Flash's head size on the GPU (fp32 in the interpreter), states in a slot pool
    with more slots than sequences, in an order of their own; `rows` a sequence (a verify's 5 or 4)."""
    b, t, h, d = (8, rows or 5, 8, 128) if big else (3, rows or 4, 2, 16)
    dt = BF16 if big else torch.float32
    z = _rand(layers, b, t, 3 * h * d, device=device, dtype=dt)
    q, k, v = (x.view(layers, b, t, h, d) for x in z.chunk(3, dim=-1))
    f = _rand(layers, b, t, h, d, device=device, dtype=dt)
    beta_logit = _rand(layers, b, t, h, device=device, dtype=dt)
    dt_bias, a_log = _rand(layers, h * d, device=device), _rand(layers, h, device=device) * 0.5
    pool = _rand(layers, b + 2, h, d, d, device=device, scale=0.1)
    slots = torch.randperm(b + 2, device=device)[:b]
    lengths = torch.arange(b, device=device) % (t + 1)  # the commit's replay: 0 to all rows
    return (q, k, v, f, dt_bias, a_log, beta_logit, -5.0), pool, slots, lengths


def case_kda_slots(device, big):
    x, pool, slots, lengths = _kda_slots_inputs(device, big)
    before = pool.clone()
    got = (kda_slots(*x, pool, slots, force_triton=True), kda_slots(*x, pool, slots, lengths, force_triton=True))
    assert torch.equal(pool, before), "the forward wrote the pool"
    return got, (kda_slots_ref(*x, pool, slots), kda_slots_ref(*x, pool, slots, lengths))


def case_kda_slots_final(device, big):
    # a shared prefill forward: each prompt's outputs and its state after its own real rows (0 to
    # all of them), over more rows than a verify has; the pool is read, not written
    x, pool, slots, _ = _kda_slots_inputs(device, big, rows=70 if big else 9)
    lengths = torch.tensor([0, 9, 5] if not big else [70, 1, 33, 64, 0, 70, 17, 2], device=device)
    before = pool.clone()
    got = (kda_slots(*x, pool, slots, final=True, force_triton=True),
           kda_slots(*x, pool, slots, lengths, final=True, force_triton=True))
    assert torch.equal(pool, before), "the prefill's forward wrote the pool"
    return got, (kda_slots_ref(*x, pool, slots, final=True), kda_slots_ref(*x, pool, slots, lengths, final=True))


def case_kda_slots_commit(device, big):
    # every KDA layer of a verify at once, written in place; untouched slots stay as they were
    x, pool, slots, lengths = _kda_slots_inputs(device, big, layers=3)
    want = pool.clone()
    kda_slots_ref(*x, want, slots, lengths, commit=True)
    assert kda_slots(*x, pool, slots, lengths, commit=True, force_triton=True) is None
    return pool, want


def _pool_keys_inputs(device, big, t):
    """A forward appending t rows to each sequence of an indexed layer's pools (P = 4): raw (key,
    gate) rows and the pool component in slot pools with more slots than rows, each sequence's
    rows scattered over them; sequences starting on a pool boundary, inside a pool and at 0, so
    the t rows complete no pool, one, or several, and the window's positions clamp at 0."""
    b, di, length = (8, 128, 96) if big else (3, 16, 24)
    dt = BF16 if big else torch.float32
    P = 4
    slots = b * length + 5
    pool = _rand(2, slots, di // P, device=device, dtype=dt)
    raw = _rand(2, slots, 2 * di, device=device, dtype=dt, scale=2.0)
    order = torch.randperm(slots, device=device)
    pool_slots = order[: b * length].view(b, length)
    raw_slots = torch.randperm(slots, device=device)[: b * length].view(b, length)
    starts = torch.tensor([0, 7, 12, 3, 40, 1, 60, 25][:b], device=device)
    ape = _rand(P, di, device=device, dtype=dt)
    return pool, raw, 1, pool_slots, raw_slots, starts, t, ape


def _case_pool_keys(device, big, t):
    args = _pool_keys_inputs(device, big, t)
    got, want = args[0].clone(), args[0].clone()
    write_pool_keys(got, *args[1:], force_triton=True)
    write_pool_keys_ref(want, *args[1:])
    assert not torch.equal(want, args[0]), "no pool was completed"
    return got, want


def case_pool_keys_decode(device, big):
    return _case_pool_keys(device, big, 1)


def case_pool_keys_verify(device, big):
    return _case_pool_keys(device, big, 4)


def case_pool_keys_prefill(device, big):
    return _case_pool_keys(device, big, 9)


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}


interpreter_results, test_interpreter_matches_reference, test_cuda_matches_reference = reference_tests(__file__, CASES)


def test_dispatch_picks_reference_on_cpu(monkeypatch):
    import kernels.kda as kd
    import kernels.mhc as hc

    def boom(*args, **kwargs):
        raise AssertionError("Triton path taken for CPU tensors")

    import kernels.pool_keys as pk
    import kernels.rmsnorm as rn
    import kernels.short_conv as sc

    for mod, name in [(kd, "kda_rows_triton"), (kd, "kda_slots_triton"), (hc, "hc_weights_triton"),
                      (hc, "hc_collapse_triton"), (hc, "hc_collapse_norm_triton"), (hc, "hc_expand_triton"),
                      (sc, "short_conv_triton"), (pk, "write_pool_keys_triton"),
                      (rn, "gated_rmsnorm_triton")]:
        monkeypatch.setattr(mod, name, boom)
    conv = _conv_inputs("cpu", False, torch.float32, 2)
    assert all(torch.equal(a, b) for a, b in zip(short_conv(*conv), short_conv_ref(*conv)))
    gate = (torch.randn(2, 4, 16), torch.randn(2, 64), torch.rand(16), 1e-5, BF16)
    assert torch.equal(gated_rmsnorm(*gate), gated_rmsnorm_ref(*gate))
    hx, hy = torch.randn(3, 4, 8), torch.randn(3, 8)
    site = (hx, torch.randn(24, 32), torch.randn(24), torch.ones(3), 1e-5, 1e-6, 20)
    pre, post, comb = hc_weights(*site)
    assert all(torch.equal(a, b) for a, b in zip((pre, post, comb), hc_weights_ref(*site)))
    assert torch.equal(hc_collapse(hx, pre), hc_collapse_ref(hx, pre))
    assert torch.equal(hc_collapse_norm(hx, pre, hy[0], 1e-5), hc_collapse_norm_ref(hx, pre, hy[0], 1e-5))
    assert torch.equal(hc_expand(hx, hy, post, comb), hc_expand_ref(hx, hy, post, comb))
    kx = [torch.randn(2, 3, 16) for _ in range(4)] + [torch.rand(2, 3), torch.randn(3, 16, 16)]
    assert all(torch.equal(a, b) for a, b in zip(kda_rows(*kx), kda_rows_ref(*kx)))
    x, pool, slots, lengths = _kda_slots_inputs("cpu", False)
    assert torch.equal(kda_slots(*x, pool, slots, lengths), kda_slots_ref(*x, pool, slots, lengths))
    keys = _pool_keys_inputs("cpu", False, 4)
    got, want = keys[0].clone(), keys[0].clone()
    write_pool_keys(got, *keys[1:])
    write_pool_keys_ref(want, *keys[1:])
    assert torch.equal(got, want)


def test_mhc_kernels_leave_autograd_to_the_references(monkeypatch):
    """Training runs the model's forward on CUDA with autograd: the kernels, which have no
    backward, must not take it (a silent stop of every gradient through the streams)."""
    import kernels.mhc as hc

    monkeypatch.setattr(hc, "use_triton", lambda *a, **k: True)
    x = torch.randn(2, 4, 8, requires_grad=True)
    pre = torch.rand(2, 4)
    hc_collapse(x, pre).sum().backward()
    torch.testing.assert_close(x.grad, pre[..., None].expand(2, 4, 8))


if __name__ == "__main__":  # the interpreter worker (test_kernels.py's module docstring)
    print(json.dumps(run_cases("cpu", False, CASES)))
