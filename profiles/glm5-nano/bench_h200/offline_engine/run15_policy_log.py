"""Device run 15's diagnostic (a script, not part of the tool): where an admission's time goes
(target and drafter prefill calls, each forward's plan: rows, sequences, static or eager) and what
the adaptive gamma policy saw at each choice (its bucket's costs and the rolling rates). It wraps
the engine's functions and runs one glm5mtp command in process, on CUDA:

    PYTHONPATH=. python3 profiles/glm5-nano/bench_h200/offline_engine/run15_policy_log.py OUT.json \
        bench --device cuda --prompts humaneval164.jsonl --num-prompts 164 --max-new-tokens 128 \
        --no-transformers --json --prefill-graphs --repeats 1 --batch-sizes 8,32,64 --gammas 3 \
        --gamma-policy adaptive          [--profile: also the CUDA kernels by time]

run15_policy_choices.json.gz is its log of a policy with commit 9deb8c4's borrowed cost lines and
measured-only costs but not yet its rate warm-up and probes below --gamma (the log that commit's
message describes); run15_admission_split.json and run15_kernels_b64_g3.json are the rest.
"""
import json, statistics, sys, time
import torch
from torch.profiler import profile, ProfilerActivity
from glm5mtp_cli.engine import gamma as G, prefill as P, speculate as S, mtp_head as M, prefill_graphs as PG
from glm5mtp_cli.cli import main

out_path, argv = sys.argv[1], sys.argv[2:]
rec = {"runs": []}
cur = None
in_fill = [False]

def sync():
    torch.cuda.synchronize()

orig_init = G.GammaPolicy.__init__
def init(self, *a, **k):
    global cur
    orig_init(self, *a, **k)
    cur = {"choices": [], "fills": [], "forwards": []}
    rec["runs"].append(cur)
G.GammaPolicy.__init__ = init

orig_choose = G.GammaPolicy.choose
def choose(self, active):
    g = orig_choose(self, active)
    if self.adaptive:
        b = G.bucket_of(active)
        line = self.line(active)
        cur["choices"].append([active, g, {k: round(statistics.median(v) * 1e3, 3) for k, v in self.costs.get(b, {}).items()},
                               {k: len(v) for k, v in self.costs.get(b, {}).items()},
                               None if line is None else {k: round(statistics.median(v) * 1e3, 3) for k, v in line.items()},
                               [round(r, 3) for r in self.rates()]])
    return g
G.GammaPolicy.choose = choose

orig_fill = S.SpecEngine._fill
def fill(self, seqs, plans):
    sync(); t0 = time.perf_counter(); in_fill[0] = True
    orig_fill(self, seqs, plans)
    sync(); in_fill[0] = False
    cur["fills"].append([len(seqs), sum(len(s.req.prompt) for s in seqs), round((time.perf_counter() - t0) * 1e3, 3)])
S.SpecEngine._fill = fill

def timed(owner, fn):
    def w(*a, **k):
        if not in_fill[0]:
            return fn(*a, **k)
        sync(); t0 = time.perf_counter()
        r = fn(*a, **k)
        sync()
        cur["forwards"].append([owner + "_call", round((time.perf_counter() - t0) * 1e3, 3)])
        return r
    return w
S.prefill_targets = timed("target", P.prefill_targets)
M.MtpHead.catchup_batch = timed("drafter", M.MtpHead.catchup_batch)

orig_plan = P.plan_forwards
def plan(remaining, headroom, chunk, budget, padded):
    out = orig_plan(remaining, headroom, chunk, budget, padded)
    if in_fill[0]:
        for t, members in out:
            cur["forwards"].append(["plan", t, len(members), sum(k for _, k in members)])
    return out
P.plan_forwards = plan
M.plan_forwards = plan

orig_pt, orig_pd = PG.PrefillForwards.target, PG.PrefillForwards.drafter
def pt(self, ids, caches, real):
    r = orig_pt(self, ids, caches, real)
    if in_fill[0]: cur["forwards"].append(["static_target", r is not None])
    return r
def pd(self, ids, hidden, caches, real):
    r = orig_pd(self, ids, hidden, caches, real)
    if in_fill[0]: cur["forwards"].append(["static_drafter", bool(r)])
    return r
PG.PrefillForwards.target, PG.PrefillForwards.drafter = pt, pd

prof = "--profile" in argv
if prof:
    argv.remove("--profile")
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        rc = main(argv)
    rows = [e for e in p.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    rows.sort(key=lambda e: -e.self_device_time_total)
    rec["kernels"] = [[round(e.self_device_time_total / 1e3, 3), e.count, e.key[:100]] for e in rows[:40]]
else:
    rc = main(argv)
rec["rc"] = rc
json.dump(rec, open(out_path, "w"))
