"""GLM-5-Next through the engine's static forwards (engine/graphs.py: the CUDA graphs' code path run
eagerly, fp32 CPU): the target's verify reads its KDA states through the runner's slot indices and
leaves their commits on the caches; greedy and sampled tokens equal eager ones through continuous
batching (more requests than slots, slots re-occupied); retire points a slot's index at the scratch
slot; the scratch slot goes back at close and leak-check is clean. CUDA: the same with graphs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from glm5mtp_cli.engine.verify import VerifyPlan
from glm5mtp_cli.engine.config import ModelSpec, EngineConfig
from glm5mtp_cli.engine.graphs import EngineGraphs
from glm5mtp_cli.engine.runtime import graph_mode, load_runtime, make_engine
from glm5mtp_cli.engine.sampling import SamplingParams
from glm5mtp_cli.engine.sequence import Request
from kernels._triton import kernel_path
from test_graphs import check_seats
from glm5mtp_cli.engine.hooks import observing
from observe import ahead_taken

# prompt, max new tokens: different lengths, budgets ending apart
TEXTS = [("def binary_search(items, target):\n", 14), ("import os\n", 6),
         ("class Stack:\n    def __init__(self):\n        self.items = []\n", 17), ("x", 9),
         ("# the sum of a list\ndef total(xs):\n", 12)]


@pytest.fixture(scope="module")
def rt():
    """The trained glm5next-nano: its drafter is accepted often, so partial KDA commits happen."""
    return load_runtime(ModelSpec("glm5next-nano", "cpu", "fp32"), progress=False)


def _work(rt):
    return [(rt.tokenizer.encode(text), n) for text, n in TEXTS]


def _run(rt, gamma, mode, slots, sampling=SamplingParams(), device="cpu"):
    pools = rt.make_pools(64, slots + 2, block_size=4)
    engine = make_engine(rt, pools, EngineConfig(gamma=gamma, sampling=sampling, max_seq_len=64, eos_ids=(), check_invariants=True, graphs=mode))
    res = engine.generate([Request(p, n, i) for i, (p, n) in enumerate(_work(rt))], batch_size=slots)
    # the commits write the KDA slots in place: state that required grad chained a node a commit
    assert not any(p.data.requires_grad for p in pools.pools.values()), "engine state joined autograd"
    if mode != "eager":
        assert engine.runner.graphs is not None, "the static forwards were not built"
        owners = ["target", "drafter"] if gamma else ["target"]
        held = sum(p.blocks_held for p in pools.pools.values())
        assert held == sum(len(pools.owners[o]) for o in owners), "one scratch block or slot per component"
    engine.close()
    assert not any(pools.blocks_held().values()), "a block, slot or scratch stayed held"
    return res


@pytest.mark.parametrize("gamma", [0, 3])
@pytest.mark.parametrize("slots", [1, 3])
def test_static_forwards_equal_eager(rt, gamma, slots):
    """Static forwards give eager's tokens; at gamma 3 most steps take the draft chain the step
    before launched ahead (drafting.launch_ahead), from the KDA target's device verdict."""
    taken = []
    with observing(ahead_taken(taken)):
        eager = _run(rt, gamma, "eager", slots)
        assert not taken  # eager forwards have no fused chain to launch ahead
        static = _run(rt, gamma, "static", slots)
    assert bool(taken) == (gamma > 0)
    assert [r.tokens for r in static] == [r.tokens for r in eager]
    assert [(r.acceptance.proposed, r.acceptance.accepted) for r in static] == \
           [(r.acceptance.proposed, r.acceptance.accepted) for r in eager]
    if gamma:
        acc = sum(r.acceptance.accepted for r in static)
        assert 0 < acc < sum(r.acceptance.proposed for r in static)  # partial commits of KDA state ran


def test_static_sampling_equals_eager(rt):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    eager = _run(rt, 2, "eager", 3, params)
    assert [r.tokens for r in _run(rt, 2, "static", 3, params)] == [r.tokens for r in eager]


def test_seated_sequences_table_rows_and_slot_indices_name_their_own(rt):
    check_seats(rt, _work(rt), 3)


def test_retire_points_the_slot_index_at_scratch_before_the_state_goes_back(rt):
    pools = rt.make_pools(64, 4, block_size=4)
    engine = make_engine(rt, pools, EngineConfig(gamma=2, max_seq_len=64, eos_ids=(), graphs="static"))
    seen = []
    real_retire = EngineGraphs.retire

    def spy(self, slot):
        before = [int(s.index[slot]) for s in self.slot_index["target"].values()]
        held = {n: set(p._held) for n, p in pools.pools.items()}
        real_retire(self, slot)
        for (name, s), was in zip(self.slot_index["target"].items(), before):
            assert int(s.index[slot]) == s.scratch != was
            assert was in held[f"target_{name}"]  # the sequence still held the slot it named
        seen.append(slot)

    EngineGraphs.retire = spy
    try:
        engine.generate([Request(p, n, i) for i, (p, n) in enumerate(_work(rt))], batch_size=2)
    finally:
        EngineGraphs.retire = real_retire
    engine.close()
    assert len(seen) == len(TEXTS) and not any(pools.blocks_held().values())


def test_leakcheck_in_static_mode_is_clean(rt):
    from glm5mtp_cli.diagnostics.leakcheck import LeakCheckConfig, run_leakcheck

    doc = run_leakcheck(rt, LeakCheckConfig(EngineConfig(gamma=2, max_new_tokens=6, max_seq_len=64, graphs="static",
                                                         batch_size=2), sequences=6))
    assert doc["verdict"] == "clean"


def test_graph_mode_captures_glm5next_on_cuda(rt):
    on_cuda = SimpleNamespace(cfg=rt.cfg, dtype=rt.dtype, target=rt.target, comm=None, device=torch.device("cuda"))
    assert graph_mode(on_cuda, True) == "cuda"
    assert graph_mode(on_cuda, False) == "eager"
    assert graph_mode(rt, True) == "eager"  # the CPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("gamma", [0, 3])
def test_cuda_graphs_equal_eager_on_gpu(gamma):
    grt = load_runtime(ModelSpec("glm5next-nano", "cuda", "fp32"), progress=False)
    for slots in (1, 3):
        want = [r.tokens for r in _run(grt, gamma, "eager", slots, device="cuda")]
        assert [r.tokens for r in _run(grt, gamma, "cuda", slots, device="cuda")] == want


@pytest.mark.parametrize("gamma", [0, 3])
def test_graph_bytes_prediction_equals_the_buffers(rt, gamma):
    """profile's cuda_graphs component for GLM-5-Next: the static inputs, the tables and slot
    indices, and the outputs a capture owns (with the KDA commit records), as EngineGraphs builds them."""
    from glm5mtp_cli.diagnostics.sizing import graph_bytes

    pools = rt.make_pools(128, 1, block_size=4)
    engine = make_engine(rt, pools, EngineConfig(gamma=gamma, max_seq_len=128, eos_ids=(), graphs="static"))
    req = Request(_work(rt)[0][0], 20)
    seq = engine.admission.start(req)
    seq.slot = 0  # seated, as the engine's schedule does
    try:
        engine._open_graphs([seq], 1, engine._table_blocks([req]))
        g = engine.runner.graphs
        (bucket,) = g.buckets.values()
        held = bucket.idx.nbytes
        for f in bucket.forwards():
            held += sum(t.nbytes for t in (f.ids, f.hidden, f.starts, f.rows) if t is not None)
        held += sum(t.table.nbytes for owner in g.tables.values() for t in owner.values())
        held += sum(s.index.nbytes for owner in g.slot_index.values() for s in owner.values())
        with kernel_path("all"):  # what CUDA graphs capture: the kernels' branch, joined projections
            out, verdict = bucket.verify[VerifyPlan.chain(gamma)].run()
        held += out.logits.nbytes + out.hidden_all.nbytes + verdict.nbytes  # `hidden` shares hidden_all's storage
        records = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()  # views held whole
                   for r in out.pending.rows for t in (r.q, r.k, r.v, r.f, r.b)}
        held += out.pending.extended.nbytes + sum(records.values())
        held += bucket.commit[VerifyPlan.chain(gamma)].kept.nbytes
        if gamma:
            held += bucket.draft[gamma].run().nbytes
        assert held == graph_bytes(rt.cfg, torch.float32, engine.admission.reserve_tokens(req), 4, gamma, 128)
    finally:
        engine.close()
        engine.lifecycle.release(seq)
    assert not any(pools.blocks_held().values())


def test_sequences_forward_reads_the_sequences_state_slots(rt):
    """step_bench's static forward over given sequences (static.sequences_forward, what bench
    captures for the target step, at --step-batch-sizes) reads each cache's own KDA slots: its
    logits equal the eager forward's over the same caches, one sequence or two."""
    from glm5mtp_cli.engine.cache import CachePools
    from glm5mtp_cli.engine.static import sequences_forward

    pools = CachePools.create(rt.cfg, 16, 4, torch.float32, "cpu", with_drafter=False)
    caches = []
    for text in (_work(rt)[0][0], _work(rt)[1][0]):
        prompt = torch.tensor([text])
        caches.append(pools.target_cache())
        caches[-1].reserve(16)  # one reservation: the tables of a batched step stack
        rt.target.commit(rt.target(prompt, caches[-1:]).pending, torch.tensor([prompt.shape[1]]))  # the prefill's state
        caches[-1].prepare(1)  # room for the step's row
    for batch in (caches[:1], caches):
        f = sequences_forward(rt.target.context, lambda f: rt.target.forward_batch(f.ids, f.context(f.starts, 1), "last"),
                              batch, 1, torch.device("cpu"))
        f.ids.fill_(42)
        f.set_starts([c.length for c in batch])
        static = f.run().logits[:, -1].clone()
        eager = rt.target(torch.full((len(batch), 1), 42), batch, rows="last").logits[:, -1]
        for c in batch:
            c.truncate(c.length - 1)
        torch.testing.assert_close(static, eager, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(static[0], static[1], atol=1e-3)  # each row read its own state
    for c in caches:
        c.release()


def _prefill_graph_runs(rt, chunk: int, mode: str):
    def run(prefill_graphs):
        pools = rt.make_pools(64, 5, block_size=4, prefill_graphs=prefill_graphs)
        engine = make_engine(rt, pools, EngineConfig(gamma=3, max_seq_len=64, eos_ids=(), graphs=mode,
                                                     prefill_graphs=prefill_graphs, prefill_chunk=chunk))
        work = _work(rt)
        res = engine.generate([Request(p, n, i) for i, (p, n) in enumerate(work)], batch_size=3)
        replays = engine.runner.prefill.replays if prefill_graphs else None
        if prefill_graphs:  # padding rows commit nothing: the scratch slot holds what it held (zeros)
            for name, slot in engine.runner.prefill.scratch_slots.items():
                assert not pools.pools[name].data[:, slot].any(), f"a padding row wrote {name}'s scratch slot"
        engine.close()
        assert not any(pools.blocks_held().values()), "a block, slot or scratch stayed held"
        return [(r.tokens, r.acceptance.proposed, r.acceptance.accepted) for r in res], replays

    static, replays = run(True)
    assert replays > 0, "no prefill forward ran from a bucket"
    assert static == run(False)[0]


@pytest.mark.parametrize("chunk", [24, 8])  # KDA 'final' prefill forwards / verify-sized ones
def test_static_prefill_forwards_equal_eager(rt, chunk):
    """--prefill-graphs' static forwards (their own slot indices; padding kept out of the KDA state,
    committed inside the forward at each member's real rows) give the eager prefill's tokens and
    acceptance; every scratch block and slot goes back at close."""
    _prefill_graph_runs(rt, chunk, "static")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_prefill_forwards_equal_eager_on_cuda():
    """Captured: each forward's KDA commit is part of its replay, reading what the replay just
    wrote (fp32, so tokens compare exactly)."""
    _prefill_graph_runs(load_runtime(ModelSpec("glm5next-nano", "cuda", "fp32"), progress=False), 24, "cuda")


@pytest.mark.parametrize("mode", ["eager", "static"])
def test_shared_topk_keeps_no_selection_past_its_propose(rt, mode):
    """index_share_for_mtp_iteration keeps step 0's pool selections for the chained steps of one
    propose only: kept past it (one per row-0 slot a sequence had used), they grew with every slot
    of a long run (+35 B a sequence over 1,000 on the H200)."""
    assert rt.mtp.share_topk
    _run(rt, 3, mode, 2)
    assert len(rt.mtp._step0) <= 2
