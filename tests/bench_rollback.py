"""Measure the two KDA rollback options of a speculative verify on ONE KDA layer at GLM-5.3-Flash
sizes (hidden 4096, 64 heads x 128, conv 4, fp32 state), gamma drafts + 1 row, on this machine: the
measurement behind models/glm5_next/decoder.DEFAULT_ROLLBACK, which the engine's batched forwards
(KdaLayer.forward_batch) follow. It times the one-sequence KdaLayer.forward, the path of the tests'
reference (tests/glm5next_reference.py), where both options remain.

  states : the verify runs the recurrent form and keeps S after every row; rollback picks one.
  replay : the verify keeps the kernel inputs (q, k, v, g, beta) and the committed S; rollback
           re-runs the kept rows' recurrent steps from it.

Prints, per option: verify time, rollback time (mean over keep = 1..gamma+1), extra bytes kept
per sequence per layer, then one JSON line. Weights are random fp32 (the projections cost the
same in both options; they are timed so the recurrence's share is visible).

    OMP_NUM_THREADS=1 python3 tests/bench_rollback.py --gamma 3 [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from glm5mtp_cli.models.glm5_next.config import NextConfig
from glm5mtp_cli.models.glm5_next.kda import KdaLayer

FLASH = dict(model_type="glm5_next_text", vocab_size=154880, hidden_size=4096, num_hidden_layers=1,
             num_attention_heads=64, intermediate_size=12288, moe_intermediate_size=2048, q_lora_rank=1536,
             kv_lora_rank=512, qk_nope_head_dim=256, v_head_dim=256, n_routed_experts=288, num_experts_per_tok=8,
             index_n_heads=32, index_head_dim=128, index_topk=2048, index_kpool=4, layer_types=["linear_attention"],
             mlp_layer_types=["dense"], linear_attn_config=dict(num_heads=64, head_dim=128, short_conv_kernel_size=4,
                                                                 gate_lower_bound=-5.0))


def _time(fn, reps: int, device: torch.device) -> float:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (fp32 throughout, as the KDA state is stored)")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    torch.manual_seed(0)
    cfg = NextConfig.from_dict(FLASH)
    layer = KdaLayer(cfg).to(dev).eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.normal_(0, 0.1)
    T = args.gamma + 1
    a = torch.randn(T, cfg.hidden_size, device=dev)
    h, d, k = cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim
    s0 = 0.01 * torch.randn(h, d, d, device=dev)
    w0 = torch.randn(k - 1, 3 * cfg.linear_dim, device=dev)
    machine = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu, torch threads={torch.get_num_threads()}"
    out: dict = {"machine": machine, "gamma": args.gamma,
                 "state_bytes": s0.nbytes}
    with torch.no_grad():
        x, _ = layer.inputs(a, w0)
        proj = _time(lambda: layer.inputs(a, w0), args.reps, dev)
        out["projections_s"] = proj
        # the per-position slots an engine keeps allocated (reused by every verify)
        slots = torch.empty(T, h, d, d, device=dev)
        for mode in ("states", "replay"):
            buf = slots if mode == "states" else None
            verify = _time(lambda: layer(a, s0, w0, mode=mode, states_out=buf), args.reps, dev)
            _, pending = layer(a, s0, w0, mode=mode, states_out=buf)
            rb = [_time(lambda: pending.commit(keep, k), args.reps, dev) for keep in range(1, T + 1)]
            extra = pending.states.nbytes if mode == "states" else pending.inputs.nbytes()
            out[mode] = {"verify_s": verify, "rollback_s_mean": sum(rb) / len(rb), "rollback_s_by_keep": rb,
                         "verify_plus_rollback_s": verify + sum(rb) / len(rb), "extra_bytes": extra}
            print(f"{mode:7s} verify {verify * 1e3:8.2f} ms  rollback {sum(rb) / len(rb) * 1e3:7.2f} ms "
                  f"(keep 1..{T}: {', '.join(f'{r * 1e3:.2f}' for r in rb)})  extra {extra / 2**20:.2f} MiB")
    print(f"projections alone: {proj * 1e3:.2f} ms; committed S: {s0.nbytes / 2**20:.0f} MiB")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
