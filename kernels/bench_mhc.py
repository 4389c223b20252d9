"""mHC's kernels (kernels/mhc.py) at glm5next-nano's width (4 streams of 256) and GLM-5.3-Flash's
(4 of 4096), 1 to 1024 rows (and at the nano's width an admission prefill's 4096 and 16384), under
several launch shapes, in CUDA graphs.

    python -m kernels.bench_mhc --out mhc.json

Per (width, rows): the site's mixing weights as shipped (`weights`: the logits and the mix), the
collapse with the block's norm and the expand as shipped, and each kernel launched directly under
other shapes: the logits with their fp32 product on the CUDA cores (`ieee`) or as three TF32
products on the tensor cores (`tf32x3`, shipped), 16 or 64 rows a program; the mix with 16, 4 or 1
rows a program (each load 32 row-splits: 2, 8 or 32 splits) and 4 or 1 warps, the expand with 256-,
128- or 64-wide tiles (1024 at Flash's width) and 4 or 1 warps, the collapse-norm with 4 or 1 warps.
The mix's partials come from the shipped split of the logits. Microseconds a call: the median of 20
replays of a graph of 50 calls (kernels/bench_kda.graph_us). Timing only: the CUDA cases of
tests/test_kernels_next.py check the kernels' values. The last line of stdout is one JSON object,
also written to ``--out``.
"""

import sys

import torch

from . import mhc
from .bench_kda import bench_rows, graph_us

STREAMS, ITERS, EPS = 4, 20, 1e-6
NANO_WIDTH = 256  # glm5next-nano's, whose admission prefills run 4096 to 16384 rows a forward
CALLS, REPLAYS = 50, 20  # a graph of 50 calls, its median replay


def _graph_us(fn) -> float:
    return graph_us(fn, REPLAYS, CALLS)


def _site(d: int, t: int, dev):
    n = STREAMS
    x = torch.randn(t, n, d, device=dev, dtype=torch.bfloat16)
    fn = torch.randn((2 + n) * n, n * d, device=dev) * 0.02
    base, scale = torch.randn((2 + n) * n, device=dev), torch.rand(3, device=dev)
    y = torch.randn(t, d, device=dev, dtype=torch.bfloat16)
    w = torch.randn(d, device=dev, dtype=torch.bfloat16)
    return x, fn, base, scale, y, w


def _one(d: int, t: int, dev) -> dict:
    n, cdiv = STREAMS, mhc._cdiv
    x, fn, base, scale, y, w = _site(d, t, dev)
    pre, post, comb = mhc.hc_weights_triton(x, fn, base, scale, EPS, EPS, ITERS)
    r = {"weights": _graph_us(lambda: mhc.hc_weights_triton(x, fn, base, scale, EPS, EPS, ITERS)),
         "collapse_norm": _graph_us(lambda: mhc.hc_collapse_norm_triton(x, pre, w, EPS)),
         "expand": _graph_us(lambda: mhc.hc_expand_triton(x, y, post, comb))}
    k, width = n * d, (2 + n) * n
    splits, per_split = mhc._logit_splits(t, k, dev)
    xs, fs = x.reshape(t, k), fn.float().contiguous()
    part, sq = torch.empty(splits, t, width, device=dev), torch.empty(splits, t, device=dev)
    for precision in ("ieee", "tf32x3"):
        for block_t in (16, 64):
            r[f"logits {precision} rows{block_t}"] = _graph_us(lambda: mhc._hc_logits_kernel[(cdiv(t, block_t), splits)](
                xs, fs, part, sq, t, k, per_split, W=width, WP=mhc.next_pow2(width), BLOCK_T=block_t,
                BLOCK_K=mhc.LOGITS_BLOCK_K, PRECISION=precision))
    part, sq = torch.randn(splits, t, width, device=dev), torch.rand(splits, t, device=dev) + 1
    outs = torch.empty(t, n, device=dev), torch.empty(t, n, device=dev), torch.empty(t, n, n, device=dev)
    for rows in (16, 4, 1):
        for warps in (4, 1):
            r[f"mix rows{rows} warps{warps}"] = _graph_us(lambda: mhc._hc_mix_kernel[(cdiv(t, rows),)](
                part, sq, base, scale, *outs, t, splits, k, EPS, EPS, ITERS, N=n, WP=mhc.next_pow2(width), BLOCK_T=rows,
                BLOCK_S=mhc.MIX_BLOCK_T * mhc.MIX_BLOCK_S // rows, num_warps=warps))
    streams, normed = torch.empty_like(x), torch.empty_like(y)
    for block in (mhc._block_d(d), 128, 64):
        for warps in (4, 1):
            r[f"expand block{block} warps{warps}"] = _graph_us(lambda: mhc._hc_expand_kernel[(t, cdiv(d, block))](
                x, y, post, comb, streams, d, N=n, BLOCK_D=block, num_warps=warps))
    for warps in (4, 1):
        r[f"collapse_norm warps{warps}"] = _graph_us(lambda: mhc._hc_collapse_norm_kernel[(t,)](
            x, pre, w, normed, d, EPS, N=n, BLOCK_D=mhc._block_d(d), num_warps=warps))
    return {"width": d, "rows": t, "logit_splits": splits, "us": {a: round(b, 2) for a, b in r.items()}}


def main(argv=None) -> int:
    cases = [(d, t) for d in (256, 4096) for t in (1, 8, 64, 256, 1024) + ((4096, 16384) if d == NANO_WIDTH else ())]
    return bench_rows("bench_mhc", __doc__, cases, _one, argv)


if __name__ == "__main__":
    sys.exit(main())
