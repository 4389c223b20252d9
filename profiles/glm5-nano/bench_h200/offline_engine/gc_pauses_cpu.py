"""The cyclic GC's pauses inside generate on this project's CPU, with and without the start-up heap
frozen (engine/runtime.freeze_startup_heap): four glm5-tiny engines (random weights, static forwards,
gamma 3) of 164 requests each at batch 64, every collection timed by gc.callbacks; prints the
collections per generation (count, total ms, longest ms).

    OMP_NUM_THREADS=1 PYTHONPATH=. python3 gc_pauses_cpu.py freeze|nofreeze
"""
import gc, sys, time, random, collections, torch
torch.set_num_threads(1)
from glm5mtp_cli.engine import runtime as RT
if sys.argv[1] == "nofreeze":
    RT.freeze_startup_heap = lambda: None
from glm5mtp_cli.engine.runtime import load_runtime, make_engine
from glm5mtp_cli.engine.sequence import Request
import glm5mtp_cli.cli, rich, typer  # noqa: F401 (the imports a command holds: the heap a collection walks)
log = []; t = {}
def cb(phase, info):
    if phase == "start": t["s"] = time.perf_counter()
    else: log.append((info["generation"], (time.perf_counter() - t["s"]) * 1e3))
rt = load_runtime("glm5-tiny", "cpu", "fp32", progress=False, random_weights=True)
print("tracked after load", len(gc.get_objects()), "frozen", gc.get_freeze_count())
gc.callbacks.append(cb)
results = []
for run in range(4):
    pools = rt.make_pools(200, 65)
    engine = make_engine(rt, pools, gamma=3, max_seq_len=256, eos_ids=[], graphs="static")
    rnd = random.Random(run)
    reqs = [Request([rnd.randrange(rt.cfg.vocab_size) for _ in range(rnd.randrange(20, 60))], 64, i) for i in range(164)]
    t0 = time.perf_counter()
    results.append(engine.generate(reqs, batch_size=64))
    engine.close()
by = collections.defaultdict(list)
for g, ms in log: by[g].append(ms)
print({g: (len(v), round(sum(v),1), round(max(v),2)) for g, v in sorted(by.items())})
