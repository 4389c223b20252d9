"""KDA's short conv (kernels/short_conv.py) against its PyTorch reference, in CUDA graphs, at
glm5next-nano's channels (q, k, v of 4 heads of 64: 768) and GLM-5.3-Flash's (64 heads of 128:
24,576): a decode (1 row) and a verify (4 rows) at batch 1, 8 and 64, and a prefill forward of 1 and
8 prompts of 512 rows.

    python -m kernels.bench_conv --out conv.json

Each case first checks the kernel's outputs against the reference's (bf16, the rows a strided slice
of a joined projection, as the layer passes them), then times both: microseconds a call, the median
of 50 replays of a graph of 10 calls (kernels/bench_kda.graph_us). The last line of stdout is one
JSON object, also written to ``--out``.
"""

import sys

import torch

from .bench_kda import bench_rows, graph_us
from .short_conv import short_conv_ref, short_conv_triton

WIDTHS = {"glm5next-nano": 3 * 4 * 64, "flash": 3 * 64 * 128}
K = 4
CASES = [(1, 1), (8, 1), (64, 1), (1, 4), (8, 4), (64, 4), (1, 512), (8, 512)]  # (sequences, rows)
REPLAYS, CALLS = 50, 10


def _inputs(b: int, t: int, c: int, dev):
    z = torch.randn(b, t, c + 64, device=dev, dtype=torch.bfloat16)[..., :c]  # a joined projection's slice
    window = torch.randn(b, K - 1, c, device=dev, dtype=torch.bfloat16)
    return z, window, torch.randn(c, K, device=dev) * 0.5


def _one(name: str, b: int, t: int, dev) -> dict:
    args = _inputs(b, t, WIDTHS[name], dev)
    (out, ext), (ref_out, ref_ext) = short_conv_triton(*args), short_conv_ref(*args)
    if not torch.equal(ext, ref_ext) or not torch.allclose(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2):
        raise AssertionError(f"short conv {name} b{b} t{t}: the kernel differs from the reference")
    return {"width": name, "batch": b, "rows": t,
            "us": {"kernel": round(graph_us(lambda: short_conv_triton(*args), REPLAYS, CALLS), 2),
                   "reference": round(graph_us(lambda: short_conv_ref(*args), REPLAYS, CALLS), 2)}}


def main(argv=None) -> int:
    return bench_rows("bench_conv", __doc__, [(name, b, t) for name in WIDTHS for b, t in CASES], _one, argv)


if __name__ == "__main__":
    sys.exit(main())
