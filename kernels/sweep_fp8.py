"""Sweep the FP8 block GEMM's decode launch parameters (programs, BLOCK_N, stages) at the GLM-5 MTP
layer's eight FP8 shapes, one and four rows, CUDA-graph replays (fp8_block.py's _DECODE_* came from it).

    python -m kernels.sweep_fp8 OUT.json

Prints, per shape and row count, the current launch against the best one and the floor (bytes read
/ 4.2 TB/s), then the single configuration fastest summed over the shapes at one row.
"""
import itertools
import json
import sys

import torch

from .fp8_block import fp8_block_matmul_ref, fp8_block_matmul_triton, fp8_block_quantize

DEV = torch.device("cuda")
CURRENT = (528, 32, 4)  # fp8_block's _DECODE_PROGRAMS, _DECODE_BLOCK_N, _DECODE_STAGES (before the sweep: 264, 64, 3)
SHAPES = {"q_a": (2048, 6144), "q_b": (16384, 2048), "kv_a": (576, 6144), "o_proj": (6144, 16384),
          "wq_b": (4096, 2048), "wk": (128, 6144), "shared_gate_up": (4096, 6144), "shared_down": (6144, 2048)}


def time_us(fn, per_replay=20, replays=10):
    """Median microseconds of one `fn`: `per_replay` calls captured in one graph, `replays` replays."""
    g = torch.cuda.CUDAGraph()
    fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for _ in range(per_replay):
            fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(replays):
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / per_replay)
    return sorted(ts)[len(ts) // 2]


def main(out_path: str) -> None:
    rows = []
    for name, (n, k) in SHAPES.items():
        w32 = torch.randn(n, k, device=DEV) * 0.02
        w, s = fp8_block_quantize(w32, (128, 128))
        for t in (1, 4):
            x = torch.randn(t, k, device=DEV, dtype=torch.bfloat16)
            ref = fp8_block_matmul_ref(x.float(), w, s)
            floor_us = (n * k + s.numel() * 4 + t * k * 2 + t * n * 2) / 4.2e12 * 1e6
            best = None
            for target, block_n, stages in itertools.product((264, 528, 1056, 2112), (32, 64, 128), (3, 4, 6)):
                def run():
                    return fp8_block_matmul_triton(x, w, s, launch=(target, block_n, stages))

                try:
                    err = ((run().float() - ref).abs().max() / ref.abs().max()).item()
                    us = time_us(run)
                except Exception as e:  # a configuration that does not compile (shared memory) is skipped
                    print(name, t, target, block_n, stages, "failed", type(e).__name__, file=sys.stderr)
                    continue
                r = {"shape": name, "n": n, "k": k, "t": t, "target": target, "block_n": block_n, "stages": stages,
                     "us": us, "floor_us": floor_us, "ratio": us / floor_us, "err": err}
                rows.append(r)
                if best is None or us < best["us"]:
                    best = r
            cur = next(r for r in rows if r["shape"] == name and r["t"] == t
                       and (r["target"], r["block_n"], r["stages"]) == CURRENT)
            print(f"{name:15s} t={t} current {cur['us']:7.1f} us ({cur['ratio']:.2f}x)  "
                  f"best {best['us']:7.1f} us ({best['ratio']:.2f}x) target={best['target']} "
                  f"block_n={best['block_n']} stages={best['stages']} floor {floor_us:.1f}", flush=True)
    json.dump(rows, open(out_path, "w"), indent=0)
    # one config for all shapes: the sum over the draft step's shapes at t=1
    by = {}
    for r in rows:
        if r["t"] == 1:
            by.setdefault((r["target"], r["block_n"], r["stages"]), []).append(r["us"])
    tot = sorted((sum(v), key) for key, v in by.items() if len(v) == len(SHAPES))
    print("sum over shapes at t=1, best configs:", [(round(a, 1), k) for a, k in tot[:6]])
    print(f"current {CURRENT}:", round(sum(by[CURRENT]), 1))


if __name__ == "__main__":
    main(sys.argv[1])
