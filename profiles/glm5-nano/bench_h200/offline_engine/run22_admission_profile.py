"""Device run 22's diagnostic (at 2c747b9's parent, ca5b72a: prefill buckets built at their second use, up
to 2048 rows). Where an admission's time goes: torch.profiler (host ops and CUDA kernels) over admissions 2-4
of the last run of each configuration of one glm5mtp bench command run in process on CUDA:

    PYTHONPATH=. python3 admprof.py OUT_PREFIX bench --device cuda ... --repeats 1

Writes OUT_PREFIX_g{gamma}.txt (per admission: sequences, prompt rows, wall ms; then the ops by own
host time and the kernels by device time, summed over the profiled admissions) and one chrome trace
of the first profiled admission (OUT_PREFIX_g{gamma}_trace.json.gz)."""
import gzip, io, json, os, sys, time
import torch
from torch.profiler import profile, ProfilerActivity
from glm5mtp_cli.engine import speculate as S
from glm5mtp_cli.cli import main

prefix, argv = sys.argv[1], sys.argv[2:]
runs = {}  # gamma -> count of generate calls
state = {"gamma": None, "call": 0, "fill": 0, "last": {}}
results = {}

orig_generate = S.SpecEngine.generate
def generate(self, requests, batch_size=1):
    runs[self.gamma] = runs.get(self.gamma, 0) + 1
    state.update(gamma=self.gamma, call=runs[self.gamma], fill=0)
    return orig_generate(self, requests, batch_size)
S.SpecEngine.generate = generate

orig_fill = S.SpecEngine._fill
def fill(self, seqs, plans):
    state["fill"] += 1
    g = state["gamma"]
    if state["call"] != 2 or not 2 <= state["fill"] <= 4:  # the timed run (repeats 1: call 2)
        return orig_fill(self, seqs, plans)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        t0 = time.perf_counter()
        orig_fill(self, seqs, plans)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    r = results.setdefault(g, {"fills": [], "cpu": {}, "cuda": {}})
    r["fills"].append((len(seqs), sum(len(s.req.prompt) for s in seqs), round(wall, 3)))
    for e in p.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            c = r["cuda"].setdefault(e.key[:90], [0.0, 0])
            c[0] += e.self_device_time_total / 1e3; c[1] += e.count
        else:
            c = r["cpu"].setdefault(e.key[:90], [0.0, 0, 0.0])
            c[0] += e.self_cpu_time_total / 1e3; c[1] += e.count; c[2] += e.cpu_time_total / 1e3
    if len(r["fills"]) == 1:
        path = f"{prefix}_g{g}_trace.json"
        p.export_chrome_trace(path)
        with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as z:
            z.write(f.read())
        os.remove(path)
S.SpecEngine._fill = fill


def labelled(name, fn):
    def w(*a, **k):
        with torch.profiler.record_function(name):
            return fn(*a, **k)
    return w


from glm5mtp_cli.engine import mtp_head as M  # noqa: E402
S.prefill_targets = labelled("glm5mtp_target_prefill", S.prefill_targets)
M.MtpHead.catchup_batch = labelled("glm5mtp_drafter_prefill", M.MtpHead.catchup_batch)

rc = main(argv)
for g, r in results.items():
    out = io.StringIO()
    out.write(f"gamma {g}: admissions (sequences, prompt rows, wall ms): {r['fills']}\n")
    cuda_total = sum(v[0] for v in r["cuda"].values())
    out.write(f"kernels: {cuda_total:.3f} ms of device time in {sum(v[1] for v in r['cuda'].values())} kernels\n")
    for k, v in sorted(r["cuda"].items(), key=lambda kv: -kv[1][0])[:30]:
        out.write(f"  {v[0]:9.3f} ms {v[1]:6d}  {k}\n")
    out.write("host ops by own time (ms, calls, ms with children):\n")
    for k, v in sorted(r["cpu"].items(), key=lambda kv: -kv[1][0])[:45]:
        out.write(f"  {v[0]:9.3f} {v[1]:6d} {v[2]:9.3f}  {k}\n")
    open(f"{prefix}_g{g}.txt", "w").write(out.getvalue())
