"""KDA's recurrence at GLM-5.3-Flash's sizes (64 heads of 128): kernels/kda.py against flash-linear-
attention's fused recurrent KDA (`fla-core`, where it is installed), in CUDA graphs.

    python -m kernels.bench_kda --out kda.json

For a decode (1 row) and a verify (4 rows) at batch 1, 8 and 64 it times, from the layer's raw
inputs (q, k, v after the conv, the forget gate's pre-activation, beta's logit) and the slot pool:

- ``gathered``: the forward before ``kda_slots``: the slots' states gathered, the gate, sigmoid and
  q/k normalisation in PyTorch, then ``kda_rows`` (no state written: the commit replays);
- ``kda_slots``: what the forward runs now: one kernel from the raw rows, states read in place;
  ``kda_slots_commit``: the commit's replay of every row, writing the states in place;
- ``kda_rows``: the kernel alone on prepared fp32 inputs;
- ``fla``: ``fused_recurrent_kda_fwd`` with the normalisation, gate and sigmoid inside its kernel,
  from the same gathered states, no state written (its read-only form);
- ``fla_slots``: fla reading and writing the states in place through ``ssm_state_indices`` (its
  continuous-batching form: it writes the state after every row, so a verify needs a slot per row).

Each output is compared with ``kda_rows_ref`` in fp32 (max error over max magnitude). Medians of 200
graph replays. The last line of stdout is one JSON object, also written to ``--out``.

A prefill (``--prefill``): B prompts of T rows, each with its own real length (varlen, the rest
padding), at Flash's heads and at glm5next-nano's (4 of 64). ``chunked`` is the model's form before
``kda_slots(final=True)`` (the prologue in PyTorch, the padding masked, ``kda_chunked`` over every
head folded); ``kda_slots_final`` the one launch; both against the reference's outputs and states.
"""

import argparse
import json
import statistics
import sys

import torch

from .kda import gated_inputs, kda_rows, kda_rows_ref, kda_slots, kda_slots_ref

H, D, LOWER = 64, 128, -5.0


def _model_inputs(q, k, v, f, b, a_log):
    """The prologue in PyTorch (kda.gated_inputs, f holding dt_bias already), folded to [T, B*H, ...]."""
    x = gated_inputs(q, k, v, f, torch.zeros(H * D, device=q.device), a_log, b, LOWER)

    def fold(t):
        return t.transpose(0, 1).reshape(t.shape[1], t.shape[0] * t.shape[2], *t.shape[3:])
    return [fold(t) for t in x]


def report(doc: dict, out: str | None) -> None:
    """A bench's result: written to `out` when given, and printed as stdout's last line."""
    if out:
        with open(out, "w") as fh:
            json.dump(doc, fh, indent=1)
    print(json.dumps(doc))


def bench_rows(name: str, doc: str, cases, one, argv=None) -> int:
    """A per-case bench's main (kernels.`name`, its module docstring `doc`): `one(*case, device)` for
    each case (a JSON row each, on stderr as it comes), then the rows with the device and torch via
    `report` (--out: also written there)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"kernels.{name} needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    rows = []
    for case in cases:
        rows.append(one(*case, dev))
        print(json.dumps(rows[-1]), file=sys.stderr)
    report({"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "rows": rows}, args.out)
    return 0


def graph_us(fn, replays: int = 200, calls: int = 1) -> float:
    """Microseconds a call of fn: the median over `replays` of a CUDA graph of `calls` calls (more
    than one spreads the graph's own launch over them; kernels/bench_mhc.py's few-us kernels)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays):
        a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(a.elapsed_time(e) * 1e3 / calls)
    return statistics.median(times)


def _err(o, ref) -> float:
    return ((o.float() - ref).abs().max() / ref.abs().max()).item()


def case(batch: int, rows: int, fla) -> dict:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(batch * 10 + rows)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=dev, generator=g).to(dtype)
    q, k, v = rnd(batch, rows, H, D), rnd(batch, rows, H, D), rnd(batch, rows, H, D)
    f = rnd(batch, rows, H, D, dtype=torch.float32)
    b = rnd(batch, rows, H)
    a_log = torch.rand(H, device=dev, generator=g) * 2 - 1
    pool = torch.randn(batch + 3, H, D, D, device=dev, generator=g) * 0.05   # a few more slots than sequences
    slots = torch.randperm(batch + 3, device=dev, generator=g)[:batch]

    prepared = _model_inputs(q, k, v, f, b, a_log)
    state = pool.index_select(0, slots).reshape(batch * H, D, D)
    ref, _ = kda_rows_ref(*prepared, state)
    ref_btd = ref.view(rows, batch, H, D).transpose(0, 1)
    out = {"batch": batch, "rows": rows}

    def model():
        x = _model_inputs(q, k, v, f, b, a_log)
        s = pool.index_select(0, slots).reshape(batch * H, D, D)
        return kda_rows(*x, s)[0]
    out["gathered_us"] = graph_us(model)
    out["gathered_err"] = _err(model(), ref)
    raw = (q[None], k[None], v[None], f[None], torch.zeros(1, H * D, device=dev), a_log[None], b[None], LOWER)
    out["kda_slots_us"] = graph_us(lambda: kda_slots(*raw, pool[None], slots))
    out["kda_slots_err"] = _err(kda_slots(*raw, pool[None], slots)[0], ref_btd)
    scratch = pool[None].clone()
    out["kda_slots_commit_us"] = graph_us(lambda: kda_slots(*raw, scratch, slots, commit=True))
    out["kda_rows_us"] = graph_us(lambda: kda_rows(*prepared, state))
    # the state floor: every sequence's state read once (and written once by a commit)
    out["state_read_floor_us"] = batch * H * D * D * 4 / 4.2e12 * 1e6
    if fla is None:
        return out
    gathered = pool.index_select(0, slots)

    def fla_ro():
        return fla(q, k, v, f, b, A_log=a_log, initial_state=gathered, inplace_final_state=False,
                   output_final_state=False, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                   use_beta_sigmoid_in_kernel=True, lower_bound=LOWER)[0]
    out["fla_us"] = graph_us(lambda: (pool.index_select(0, slots), fla_ro()))
    out["fla_err"] = _err(fla_ro(), ref_btd)
    if rows == 1:
        work = pool.clone()

        def fla_slots():
            return fla(q, k, v, f, b, A_log=a_log, initial_state=work, inplace_final_state=True,
                       ssm_state_indices=slots.to(torch.int32), use_qk_l2norm_in_kernel=True,
                       use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=LOWER)[0]
        out["fla_slots_us"] = graph_us(fla_slots)
        work.copy_(pool)
        out["fla_slots_err"] = _err(fla_slots(), ref_btd)
    return out


def prefill_case(heads: int, dim: int, batch: int, rows: int) -> dict:
    from glm5mtp_cli.models.glm5_next.kda import KdaInputs, kda_chunked

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(heads * batch + rows)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=dev, generator=g).to(dtype)
    q, k, v = rnd(1, batch, rows, heads, dim), rnd(1, batch, rows, heads, dim), rnd(1, batch, rows, heads, dim)
    f, b = rnd(1, batch, rows, heads, dim), rnd(1, batch, rows, heads)
    dt_bias, a_log = torch.zeros(1, heads * dim, device=dev), torch.rand(1, heads, device=dev, generator=g) * 2 - 1
    pool = torch.randn(1, batch + 1, heads, dim, dim, device=dev, generator=g) * 0.05
    slots = torch.randperm(batch + 1, device=dev, generator=g)[:batch]
    real = torch.randint(rows // 2, rows + 1, (batch,), device=dev, generator=g)
    real[0] = rows
    raw = (q, k, v, f, dt_bias, a_log, b, LOWER, pool, slots, real)

    def chunked():
        x = gated_inputs(q[0], k[0], v[0], f[0], dt_bias, a_log, b[0], LOWER)
        live = torch.arange(rows, device=dev)[None, :] < real[:, None]
        x = KdaInputs(x[0], x[1], x[2], x[3] * live[..., None, None], x[4] * live[..., None]).folded()
        return kda_chunked(x, pool[0].index_select(0, slots).reshape(batch * heads, dim, dim))
    want_o, want_s = kda_slots_ref(*raw, final=True)
    o, s_after = kda_slots(*raw, final=True)
    live = (torch.arange(rows, device=dev)[None, :] < real[:, None])[None, :, :, None, None]
    c_o, c_s = chunked()
    c_o = c_o.view(rows, batch, heads, dim).transpose(0, 1)[None]
    return {"heads": heads, "dim": dim, "batch": batch, "rows": rows, "real_rows": int(real.sum()),
            "chunked_us": graph_us(chunked, 20), "kda_slots_final_us": graph_us(lambda: kda_slots(*raw, final=True), 20),
            "chunked_err": max(_err(c_o * live, want_o), _err(c_s.view(want_s.shape), want_s)),
            "kda_slots_final_err": max(_err(o, want_o), _err(s_after, want_s))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--prefill", action="store_true", help="time prefill forwards (module docstring)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("kernels.bench_kda needs CUDA; nothing timed")
        return
    if a.prefill:
        shapes = [(H, D, 1, 128), (H, D, 1, 1024), (H, D, 8, 256), (H, D, 1, 4096),
                  (4, 64, 1, 128), (4, 64, 8, 256), (4, 64, 64, 256), (4, 64, 16, 1024)]
        rows = []
        for shape in shapes:
            rows.append(prefill_case(*shape))
            print(json.dumps(rows[-1]), flush=True)
        doc = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "prefill": rows}
        report(doc, a.out)
        return
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla
    except ImportError:
        print("fla-core is not installed (pip install fla-core): timing kernels/kda.py alone", file=sys.stderr)
        fla = None
    rows = [case(bs, t, fla) for bs in (1, 8, 64) for t in (1, 4)]
    for r in rows:
        print(json.dumps(r), flush=True)
    doc = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "fla": fla is not None, "cases": rows}
    report(doc, a.out)


if __name__ == "__main__":
    main()
