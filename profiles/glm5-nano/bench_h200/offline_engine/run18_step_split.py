"""Device runs 18, 19 and 21's diagnostic (a script, not part of the tool): where a decode step's and an
admission's wall time go, per run of one glm5mtp command run in process on CUDA:

    PYTHONPATH=. python3 run18_step_split.py OUT.json bench --device cuda ... [--profile-batch B] [--force-max]

Per step: its active sequences, gamma, host wall (ms), the host time since the previous step ended
(`gap`: admissions and the loop; runs 19 and 21), and the host time of its parts (choosing gamma and
the backlog catch-up, the draft call, the verify call, accept: which waits for the device; the rest is
per-sequence bookkeeping), and the device time of each graph replay inside it (CUDA events around
StaticForward.run: `gpu_chain`, `gpu_verify`). Per admission: sequences, prompt rows, and wall ms of
the whole phase, of the target's prefill and of the drafter's (synchronized around each). Per run:
its generate wall and the engine's prefill / decode / capture split (run 21). With --profile-batch
B, the fixed-gamma runs at batch B also record the CUDA kernels of 20 of their steps
(torch.profiler; run 18). --force-max (run 21): adaptive runs keep their graphs and bookkeeping but
always draft --gamma. The wrappers add host time of their own (run 18's step walls are above what
bench measured for the same configurations), so compare within a file.
"""
import json, sys, time
import torch
from torch.profiler import profile, ProfilerActivity
from glm5mtp_cli.engine import speculate as S, mtp_head as M, graphs as GR
from glm5mtp_cli.cli import main

out_path, argv = sys.argv[1], sys.argv[2:]
prof_batch = None
force_max = "--force-max" in argv  # adaptive runs keep their graphs and bookkeeping but always draft --gamma
if force_max:
    argv.remove("--force-max")
if "--profile-batch" in argv:
    i = argv.index("--profile-batch")
    prof_batch = int(argv[i + 1])
    del argv[i:i + 2]
rec = {"runs": []}
cur = {"run": None, "step": None, "label": None, "fill": None, "prof": None}


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def ms(t0):
    return round((time.perf_counter() - t0) * 1e3, 4)


orig_generate = S.SpecEngine.generate
def generate(self, requests, batch_size=1):
    run = {"gamma": self.gamma, "adaptive": self.policy.adaptive, "batch": batch_size, "schedule": self.schedule,
           "steps": [], "fills": [], "kernels": None}
    cur["run"] = run
    cur["end"] = None
    rec["runs"].append(run)
    w0 = (self.wall_prefill_s, self.wall_decode_s, self.wall_capture_s)
    t0 = time.perf_counter()
    r = orig_generate(self, requests, batch_size)
    sync()
    run["generate_ms"] = ms(t0)
    run["prefill_ms"], run["decode_ms"], run["capture_ms"] = [round((a - b) * 1e3, 3) for a, b in
                                                             zip((self.wall_prefill_s, self.wall_decode_s, self.wall_capture_s), w0)]
    for st in run["steps"]:
        for label, e0, e1 in st.pop("ev", []):
            st["gpu_" + label] = round(st.get("gpu_" + label, 0.0) + e0.elapsed_time(e1), 4)
    cur["run"] = None
    return r
S.SpecEngine.generate = generate


orig_step = S.SpecEngine._step
def step(self, active):
    run = cur["run"]
    st = {"a": len(active)}
    n = len(run["steps"])
    run["steps"].append(st)
    cur["step"] = st
    profiling = (prof_batch is not None and run["batch"] == prof_batch and not run["adaptive"]
                 and run["kernels"] is None and len(active) == prof_batch)
    if profiling and cur["prof"] is None and n >= 60:
        cur["prof"] = profile(activities=[ProfilerActivity.CUDA])
        cur["prof"].__enter__()
        cur["prof_steps"] = 0
    if cur["prof"] is not None:
        st["profiled"] = True
    t0 = time.perf_counter()
    if cur.get("end") is not None:
        st["gap"] = round((t0 - cur["end"]) * 1e3, 4)
    orig_step(self, active)
    st["wall"] = ms(t0)
    cur["end"] = time.perf_counter()
    cur["step"] = None
    if cur["prof"] is not None:
        cur["prof_steps"] += 1
        if cur["prof_steps"] == 20:
            sync()
            p = cur["prof"]
            p.__exit__(None, None, None)
            cur["prof"] = None
            rows = [e for e in p.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
            rows.sort(key=lambda e: -e.self_device_time_total)
            run["kernels"] = {"steps": 20, "total_ms": round(sum(e.self_device_time_total for e in rows) / 1e3, 3),
                              "count": sum(e.count for e in rows),
                              "top": [[round(e.self_device_time_total / 1e3, 3), e.count, e.key[:90]] for e in rows[:30]]}
S.SpecEngine._step = step


def host_part(name, fn, label=None):
    def w(*a, **k):
        st = cur["step"]
        if st is None:
            return fn(*a, **k)
        prev = cur["label"]
        cur["label"] = label or prev
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            st[name] = round(st.get(name, 0.0) + (time.perf_counter() - t0) * 1e3, 4)
            cur["label"] = prev
    return w


S.SpecEngine._choose_gamma = host_part("choose", S.SpecEngine._choose_gamma)
S.SpecEngine._catch_up_backlog = host_part("backlog", S.SpecEngine._catch_up_backlog, "backlog")
S.SpecEngine.draft = host_part("draft", S.SpecEngine.draft, "chain")
GR.ForwardRunner.verify = host_part("verify", GR.ForwardRunner.verify, "verify")
S.SpecEngine._accept = host_part("accept", S.SpecEngine._accept)

orig_choose_g = S.SpecEngine._choose_gamma
def choose_g(self, active):
    g = orig_choose_g(self, active)
    if cur["step"] is not None:
        cur["step"]["g"] = g
    return g
S.SpecEngine._choose_gamma = choose_g
if force_max:
    from glm5mtp_cli.engine import gamma as GM
    orig_pchoose = GM.GammaPolicy.choose
    GM.GammaPolicy.choose = lambda self, active: (orig_pchoose(self, active), self.max_gamma)[1]

orig_run = GR.StaticForward.run
def run_forward(self):
    st = cur["step"]
    if st is None or self.graph is None:
        return orig_run(self)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    out = orig_run(self)
    e1.record()
    st.setdefault("ev", []).append((cur["label"] or "other", e0, e1))
    return out
GR.StaticForward.run = run_forward


orig_fill = S.SpecEngine._fill
def fill(self, seqs, plans):
    sync()
    t0 = time.perf_counter()
    f = {"n": len(seqs), "rows": sum(len(s.req.prompt) for s in seqs)}
    cur["fill"] = f
    orig_fill(self, seqs, plans)
    sync()
    f["ms"] = ms(t0)
    cur["fill"] = None
    if cur["run"] is not None:
        cur["run"]["fills"].append(f)
S.SpecEngine._fill = fill


def timed(name, fn):
    def w(*a, **k):
        f = cur["fill"]
        if f is None:
            return fn(*a, **k)
        sync()
        t0 = time.perf_counter()
        r = fn(*a, **k)
        sync()
        f[name] = round(f.get(name, 0.0) + (time.perf_counter() - t0) * 1e3, 4)
        return r
    return w


S.prefill_targets = timed("target", S.prefill_targets)
M.MtpHead.catchup_batch = timed("drafter", M.MtpHead.catchup_batch)

rc = main(argv)
rec["rc"] = rc
json.dump(rec, open(out_path, "w"))
