"""Time every Triton kernel against its PyTorch reference at GLM-5's decode shapes.

    python -m kernels.bench --out bench.json

For each case it first checks the Triton output against the reference on the GPU, with the
output NaN-poisoned before the launch, then times both with ``triton.testing.do_bench`` (median
ms) and reports achieved GB/s from the bytes each kernel must move at least (every input read
once, every output written once). The last line of stdout is one JSON object, also written to
``--out``. Without CUDA or Triton it says so and exits 0. Runs in well under 3 minutes on an H200.
"""

import argparse
import json
import sys

import torch

from . import _triton
from .fp8_block import fp8_block_dequant_ref, fp8_block_dequant_triton, fp8_block_matmul_ref, fp8_block_matmul_triton
from .paged import indexer_scores_paged_ref, indexer_scores_paged_triton, mla_attention_paged_ref, mla_attention_paged_triton
from .moe import moe_experts_ref, moe_experts_triton
from .rmsnorm import rmsnorm_ref, rmsnorm_triton
from .rope import rope_interleaved_ref, rope_interleaved_triton
from .swiglu import swiglu_ref, swiglu_triton

HBM_PEAK_GBS = 4800.0  # H200 HBM3e, for the "% of peak" column only
BF16 = torch.bfloat16


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _one_seq(fn, rows):
    """`fn` (a paged op) over ONE sequence whose rows sit in pool rows 0..T-1 at cached length `off`."""
    def run(*args, off, index=None, mla=False):
        slots = torch.arange(rows.shape[0], device=rows.device)[None]
        starts = torch.tensor([off], device=rows.device)
        if mla:
            qn, qp, scale = args
            return fn(qn[None], qp[None], rows, slots, starts, None if index is None else index[None], scale)[0]
        q, w, scale = args
        return fn(q[None], rows, slots, starts, w[None], scale)[0]
    return run


def _cases(dev):
    """Yield (name, triton_fn, ref_fn, bytes moved, relative tolerance) at GLM-5 shapes."""
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, dtype=BF16, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=g) * scale).to(dtype)

    def fp8(n, k):
        w = rnd(n, k, dtype=torch.float32, scale=40.0).clamp(-448, 448).to(torch.float8_e4m3fn)
        s = torch.rand((n + 127) // 128, (k + 127) // 128, device=dev, generator=g) * 0.02 + 0.001
        return w, s

    s_dec = 4  # queries per verify step (1 + 3 drafts)

    # RMSNorm: hidden 6144 fused with the residual add; kv latent 512 as a strided slice
    x, r, w = rnd(s_dec, 6144), rnd(s_dec, 6144), rnd(6144)
    yield ("rmsnorm_residual[4x6144]", lambda: rmsnorm_triton(x, w, 1e-5, r), lambda: rmsnorm_ref(x, w, 1e-5, r),
           _nbytes(x, r, w) + 2 * _nbytes(x), 1e-2)
    kv = rnd(s_dec, 576)
    lat, w2 = kv[:, :512], rnd(512)
    yield ("rmsnorm_latent[4x512 strided]", lambda: rmsnorm_triton(lat, w2, 1e-5), lambda: rmsnorm_ref(lat, w2, 1e-5),
           2 * s_dec * 512 * 2 + _nbytes(w2), 1e-2)

    # SwiGLU on the shared expert's joined gate-up projection [4, 2 x 2048], GLM-5-Next's clamp at 10
    gu = rnd(s_dec, 2 * 2048, scale=4.0)
    sg, su = gu[:, :2048], gu[:, 2048:]
    yield ("swiglu_shared[4x2048 clamped]", lambda: swiglu_triton(sg, su, 10.0), lambda: swiglu_ref(sg, su, 10.0),
           _nbytes(gu) + s_dec * 2048 * 2, 1e-2)

    # interleaved rope on q's rope slice [S, 64 heads, 64] of [S, 64, 256]
    q = rnd(s_dec, 64, 256)
    qr = q[..., 192:]
    cos, sin = rnd(s_dec, 32, dtype=torch.float32), rnd(s_dec, 32, dtype=torch.float32)
    yield ("rope_q[4x64x64]", lambda: rope_interleaved_triton(qr, cos, sin), lambda: rope_interleaved_ref(qr, cos, sin),
           2 * s_dec * 64 * 64 * 2 + _nbytes(cos, sin), 1e-2)

    # FP8 block weights: q_b_proj [16384, 2048] dequantised; decode GEMMs at T = 4
    wq, sq = fp8(16384, 2048)
    yield ("fp8_dequant[16384x2048->bf16]", lambda: fp8_block_dequant_triton(wq, sq, 128, BF16),
           lambda: fp8_block_dequant_ref(wq, sq, 128, BF16), _nbytes(wq, sq) + wq.numel() * 2, 1e-2)
    for name, n, k in [("q_b_proj", 16384, 2048), ("o_proj", 6144, 16384), ("expert_up", 2048, 6144)]:
        wm, sm = fp8(n, k) if (n, k) != (16384, 2048) else (wq, sq)
        xm = rnd(s_dec, k, scale=0.1)
        yield (f"fp8_matmul_{name}[4x{k}@{n}x{k}]", lambda xm=xm, wm=wm, sm=sm: fp8_block_matmul_triton(xm, wm, sm),
               lambda xm=xm, wm=wm, sm=sm: fp8_block_matmul_ref(xm, wm, sm), _nbytes(xm, wm, sm) + s_dec * n * 2, 1e-2)

    # DSA indexer over a 131072-token context: 32 heads x 128
    t_ctx = 131072
    iq, ik, iw = rnd(s_dec, 32, 128), rnd(t_ctx, 128), rnd(s_dec, 32, dtype=torch.float32)
    off = t_ctx - s_dec
    itri, iref = _one_seq(indexer_scores_paged_triton, ik), _one_seq(indexer_scores_paged_ref, ik)
    yield ("indexer_scores[4x32x128, T=131072]", lambda: itri(iq, iw, 128 ** -0.5, off=off),
           lambda: iref(iq, iw, 128 ** -0.5, off=off), _nbytes(iq, ik, iw) + s_dec * t_ctx * 4, 1e-4)

    # absorbed MLA: 64 heads, latent 512 + rope 64; dense over 4096 keys, indexed 2048 of 131072
    qn, qp = rnd(s_dec, 64, 512, scale=0.3), rnd(s_dec, 64, 64, scale=0.3)
    scale = 256 ** -0.5
    cache = rnd(t_ctx, 576)
    dense = cache[:4096]
    mtri, mref = _one_seq(mla_attention_paged_triton, dense), _one_seq(mla_attention_paged_ref, dense)
    yield ("mla_dense[4x64, T=4096]", lambda: mtri(qn, qp, scale, off=4096 - s_dec, mla=True),
           lambda: mref(qn, qp, scale, off=4096 - s_dec, mla=True),
           _nbytes(qn, qp, dense) + _nbytes(qn), 1e-2)
    idx = torch.stack([torch.randperm(t_ctx - s_dec, device=dev, generator=g)[:2048] for _ in range(s_dec)])
    idx = idx.to(torch.int32)
    yield ("mla_indexed[4x64, K=2048 of 131072]",
           lambda: _one_seq(mla_attention_paged_triton, cache)(qn, qp, scale, off=t_ctx - s_dec, index=idx, mla=True),
           lambda: _one_seq(mla_attention_paged_ref, cache)(qn, qp, scale, off=t_ctx - s_dec, index=idx, mla=True),
           _nbytes(qn, qp, idx) + s_dec * 2048 * 576 * 2 + _nbytes(qn), 1e-2)

    # routed experts (bf16): H 6144, I 2048, top-8 of 64 stacked experts (GLM-5 has 256 per layer; 64 of
    # them keep the tensors at 4.8 GB); the floor reads each distinct chosen expert's gate, up and down once
    n_exp, hid, inter, top = 64, 6144, 2048, 8
    gate, up = rnd(n_exp, inter, hid, scale=hid ** -0.5), rnd(n_exp, inter, hid, scale=hid ** -0.5)
    down = rnd(n_exp, hid, inter, scale=inter ** -0.5)
    for n_tok in (1, s_dec):
        xe = rnd(n_tok, hid)
        ids = torch.stack([torch.randperm(n_exp, device=dev, generator=g)[:top] for _ in range(n_tok)])
        wts = torch.softmax(rnd(n_tok, top, dtype=torch.float32), -1)
        distinct = ids.unique().numel()
        yield (f"moe_experts[{n_tok}x{hid}, top-{top}: {distinct} experts]",
               lambda xe=xe, wts=wts, ids=ids: moe_experts_triton(xe, gate, up, down, wts, ids),
               lambda xe=xe, wts=wts, ids=ids: moe_experts_ref(xe, gate, up, down, wts, ids),
               distinct * 3 * hid * inter * 2 + _nbytes(xe, wts, ids) + _nbytes(xe), 1e-2)


def _check(got, want, rel: float) -> tuple[bool, float]:
    """(ok, error relative to the reference's largest finite magnitude); NaN fails."""
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    worst, ok = 0.0, True
    for g, w in zip(got, want):
        g, w = g.float(), w.float()
        if g.shape != w.shape or g.isnan().any():
            return False, float("nan")
        fin = torch.isfinite(w)
        if not torch.equal(fin, torch.isfinite(g)) or not torch.equal(g[~fin], w[~fin]):
            return False, float("inf")
        peak = w[fin].abs().max().item() if fin.any() else 1.0
        err = (g[fin] - w[fin]).abs().max().item() / max(peak, 1e-30) if fin.any() else 0.0
        worst = max(worst, err)
        ok = ok and err <= rel
    return ok, worst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the JSON summary to this file")
    args = ap.parse_args(argv)

    def finish(summary: dict) -> int:
        line = json.dumps(summary)
        if args.out:
            with open(args.out, "w") as fh:
                fh.write(line + "\n")
        print(line)
        return 0

    if not torch.cuda.is_available() or not _triton.HAVE_TRITON:
        reason = "no CUDA device" if not torch.cuda.is_available() else "triton not importable"
        print(f"kernels.bench: skipped ({reason})", file=sys.stderr)
        return finish({"skipped": reason})

    import triton
    from triton.testing import do_bench

    dev = torch.device("cuda")
    print(f"device {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, triton {triton.__version__}; "
          f"GB/s from the minimum bytes moved, % of {HBM_PEAK_GBS:.0f} GB/s")
    print(f"{'case':44s} {'ok':>3s} {'err':>8s} {'MB':>8s} {'triton ms':>10s} {'GB/s':>7s} {'%pk':>5s} "
          f"{'ref ms':>9s} {'GB/s':>7s} {'speedup':>8s}")
    rows = []
    for name, tri, ref, nbytes, rel in _cases(dev):
        _triton.POISON_OUTPUTS = True  # the checked launch starts from NaN outputs
        got = tri()
        want = ref()
        torch.cuda.synchronize()
        _triton.POISON_OUTPUTS = False
        ok, err = _check(got, want, rel)
        del got, want
        t_tri = do_bench(tri, warmup=25, rep=100, return_mode="median")
        t_ref = do_bench(ref, warmup=25, rep=100, return_mode="median")
        gbs_tri, gbs_ref = nbytes / t_tri / 1e6, nbytes / t_ref / 1e6
        print(f"{name:44s} {'yes' if ok else 'NO':>3s} {err:8.1e} {nbytes / 1e6:8.2f} {t_tri:10.4f} {gbs_tri:7.0f} "
              f"{100 * gbs_tri / HBM_PEAK_GBS:5.1f} {t_ref:9.4f} {gbs_ref:7.0f} {t_ref / t_tri:7.2f}x")
        rows.append({"case": name, "ok": ok, "err": err, "bytes": nbytes, "triton_ms": t_tri, "ref_ms": t_ref,
                     "triton_gbs": gbs_tri, "ref_gbs": gbs_ref, "speedup": t_ref / t_tri})
    return finish({"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                   "triton": triton.__version__, "all_ok": all(r["ok"] for r in rows), "cases": rows})


if __name__ == "__main__":
    sys.exit(main())
