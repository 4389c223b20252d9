"""Could the `--no-draft-mask` walk run beside the step's launches? A probe, not a test, CUDA only.

A constrained step's host path is serial where the free step's is not (profiles/constrained/RESULTS.md,
"where glm5next-nano's step goes"): the walk fills the masks, and only then are the masked verdict,
the commit and the next chain launched, which the free step launches while its verify runs. Two
things would let them overlap, and this measures both on the machine it runs on:

- the walk of batch 8 (rows 0-3, built as tests/grammar_host_cost.py builds it) in one llguidance
  call on a helper thread (the lock released for the whole call), while this thread launches a
  step's worth of small device ops and graph replays: the wall time against the two one after the
  other, and the launches' own time beside a walker against alone;
- the device waiting on a host flag (the driver's cuStreamWaitValue32 on pinned memory), so that
  the launches could be queued before the masks exist and released by one host store: whether it
  is available, and the time from the store to the work behind it finishing.

Medians of 200 rounds; one line per measurement.

    python3 tests/constrained_overlap_probe.py
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from grammar_host_cost import OBJECT, STARTS, _grammars  # noqa: E402
from glm5mtp_cli.constraint import llguidance  # noqa: E402
from glm5mtp_cli.engine.config import ModelSpec  # noqa: E402
from glm5mtp_cli.engine.grammar import _walk  # noqa: E402
from glm5mtp_cli.engine.runtime import load_runtime  # noqa: E402
from glm5mtp_cli.prompts import read_file  # noqa: E402

ROUNDS = 200


def median_us(fn) -> float:
    for _ in range(20):
        fn()
    ts = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(ts)


def walk_setup():
    """8 matchers at different depths of the function-call object, each with its next 3 tokens as
    drafts, and a host mask buffer [8, 4, W]."""
    rt = load_runtime(ModelSpec("glm5-nano", "cpu", "fp32"), progress=False)
    rule = read_file(ROOT / "profiles" / "constrained" / "prompts.jsonl")[0].constraint
    ids = rt.tokenizer.encode(OBJECT)
    g = _grammars(rt)
    seqs = [g.open(rule, set(rt.cfg.eos_token_id)) for _ in STARTS]
    for s, n in zip(seqs, STARTS):
        assert s.matcher.try_consume_tokens(ids[:n]) == n
    rows = torch.full((len(STARTS), 4, g.words), -1, dtype=torch.int32, pin_memory=True)
    members = [(s.matcher, b * 4, ids[n:n + 3]) for b, (s, n) in enumerate(zip(seqs, STARTS))]
    return rows, members


def launches_setup():
    """What a step launches after its verdict, in kind: about 20 small device ops and 2 replays."""
    x = torch.zeros(8, 4, dtype=torch.long, device="cuda")
    y = torch.ones(8, 4, dtype=torch.long, device="cuda")
    h = torch.zeros(8, 4, 64, device="cuda")
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        (h * 2 + 1).sum()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = (h * 2 + 1).sum(-1)

    def launch() -> None:
        for _ in range(4):
            a = torch.add(x, 1)
            pos = torch.arange(4, device="cuda")
            w = torch.where(pos[None, :] < a[:, :1], y, a)
            c = torch.cat([w, a[:, :1]], dim=1)
            x.copy_(c[:, :4])
        graph.replay()
        out.clone()
        graph.replay()
        out.clone()
    return launch


def overlap(rows, members, launch, one_call: bool) -> tuple[float, float, float]:
    """(wall, this thread's launches, the join's wait) in µs, medians: the walk on a helper thread
    (one llguidance call, or one llguidance call per mask as the engine's calling-thread walk makes
    them) while this thread launches."""
    pool = ThreadPoolExecutor(max_workers=1)
    ex = llguidance().LLExecutor(num_threads=1)
    size = rows.shape[-1] * rows.element_size()

    def walk() -> None:
        if one_call:
            ex.unsafe_compute_mask_ptr_with_draft_token(members, rows.data_ptr(), size, rows.numel() // rows.shape[-1])
        else:
            for m, r, toks in members:
                _walk(m, rows.view(-1, rows.shape[-1]), r, toks)

    walls, parts, waits = [], [], []
    for i in range(ROUNDS + 20):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fut = pool.submit(walk)
        launch()
        t1 = time.perf_counter()
        fut.result()
        t2 = time.perf_counter()
        if i >= 20:
            walls.append(t2 - t0)
            parts.append(t1 - t0)
            waits.append(t2 - t1)
    pool.shutdown()
    return tuple(1e6 * statistics.median(v) for v in (walls, parts, waits))


def gate_probe() -> str:
    """Whether the device waits on a pinned host flag (cuStreamWaitValue32_v2), and the time from the
    host's store to the work queued behind the wait finishing."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        wait = cuda.cuStreamWaitValue32_v2
    except (OSError, AttributeError) as e:
        return f"unavailable: {e}"
    wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    dptr = ctypes.c_uint64()
    rc = cuda.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), ctypes.c_void_p(flag.data_ptr()), 0)
    if rc:
        return f"no device pointer for pinned memory (CUresult {rc})"
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    marker = torch.zeros(1, device="cuda")
    view = flag.numpy()
    latencies, held = [], 0
    torch.cuda.synchronize()
    for k in range(1, 51):
        try:
            rc = wait(stream, dptr.value, k, 0)  # CU_STREAM_WAIT_VALUE_GEQ
            if rc:
                return f"cuStreamWaitValue32_v2 refused (CUresult {rc})"
            marker.add_(1)
            done = torch.cuda.Event()
            done.record()
            time.sleep(0.001)
            held += not done.query()
            t0 = time.perf_counter()
        finally:
            view[0] = k  # the device never waits past this call, whatever failed
        done.synchronize()
        latencies.append(time.perf_counter() - t0)
    ok = marker.item() == 50
    return (f"available: the device waited in {held} of 50 rounds, the work behind it done "
            f"{1e6 * statistics.median(latencies):.0f} us after the host's store (median), marker {'ok' if ok else 'WRONG'}")


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("this probe needs CUDA")
    rows, members = walk_setup()
    launch = launches_setup()
    ex = llguidance().LLExecutor(num_threads=1)
    size = rows.shape[-1] * rows.element_size()
    one = median_us(lambda: ex.unsafe_compute_mask_ptr_with_draft_token(
        members, rows.data_ptr(), size, rows.numel() // rows.shape[-1]))
    flat = rows.view(-1, rows.shape[-1])
    serial = median_us(lambda: [_walk(m, flat, r, toks) for m, r, toks in members])
    alone = median_us(launch)
    print(f"walk, batch 8, rows 0-3: one llguidance call (1 pool thread) {one:.0f} us; the engine's "
          f"calling-thread walk {serial:.0f} us")
    print(f"launches alone {alone:.0f} us; one after the other {one + alone:.0f} us")
    for one_call in (True, False):
        wall, part, wait_ = overlap(rows, members, launch, one_call)
        name = "one call" if one_call else "a call per mask"
        print(f"walk on a helper thread ({name}) beside the launches: wall {wall:.0f} us, "
              f"launches {part:.0f} us, join wait {wait_:.0f} us")
    print("device wait on a host flag: " + gate_probe())


if __name__ == "__main__":
    main()
