"""Static decode forwards (graphs.py): the buffers a CUDA graph replays, run eagerly on the CPU,
give exactly the eager engine's tokens and acceptance, and keep the slot-reuse invariant."""

from __future__ import annotations

import pytest
import torch

from glm5mtp_cli.engine.verify import VerifyPlan
from glm5mtp_cli.engine.config import EngineConfig
from glm5mtp_cli.checkpoint.load import load_models
from glm5mtp_cli.checkpoint.resolve import resolve_model
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.engine.graphs import EngineGraphs, ForwardRunner
from glm5mtp_cli.engine.hooks import observing
from glm5mtp_cli.engine.runtime import Runtime, make_engine
from glm5mtp_cli.engine.sampling import SamplingParams
from glm5mtp_cli.engine.sequence import Request
from observe import Around, ahead_taken


@pytest.fixture(scope="module")
def rt(spec_runtime):
    return spec_runtime


# Different lengths, one over index_topk (8), and budgets that end at different steps.
REQUESTS = [([3, 17, 99, 4, 250], 20), (list(range(10, 40)), 13), ([7] * 3 + list(range(60, 81)), 24)]


def _run(rt, gamma, mode, batch, sampling=SamplingParams(), eos=(), alloc="budget"):
    pools = rt.make_pools(128, batch, block_size=4)
    engine = make_engine(rt, pools, EngineConfig(gamma=gamma, sampling=sampling, max_seq_len=128, alloc=alloc, eos_ids=tuple(eos), check_invariants=True, graphs=mode))
    res = engine.generate([Request(p, n, i) for i, (p, n) in enumerate(REQUESTS)], batch_size=batch)
    assert (engine.runner.graphs is not None) == (mode != "eager")  # kept for the engine's next call
    engine.close()
    assert not any(pools.blocks_held().values()), "a block stayed held after the run"
    assert engine.runner.graphs is None
    return res


@pytest.mark.parametrize("gamma", [0, 1, 3])
@pytest.mark.parametrize("batch", [1, 3])
def test_static_forwards_equal_eager(rt, gamma, batch):
    eager = _run(rt, gamma, "eager", batch)
    static = _run(rt, gamma, "static", batch)
    assert [r.tokens for r in static] == [r.tokens for r in eager]
    assert [(r.acceptance.proposed, r.acceptance.accepted) for r in static] == \
        [(r.acceptance.proposed, r.acceptance.accepted) for r in eager]
    if gamma:
        acc = sum(r.acceptance.accepted for r in static)
        assert 0 < acc < sum(r.acceptance.proposed for r in static)  # accepted and rejected paths ran


@pytest.mark.parametrize("gamma", [0, 3])
def test_a_greedy_static_verify_computes_its_verdict(rt, gamma, monkeypatch):
    """A greedy engine's static verify computes the accept's verdict in its forward
    (graphs.verify_forward): the step reads it whole and no greedy match runs after it (its tokens
    equal eager's: the test above)."""
    from glm5mtp_cli.engine import accept

    matched = []
    match = accept.greedy_verdict
    monkeypatch.setattr(accept, "greedy_verdict", lambda *args, **kw: matched.append(args) or match(*args, **kw))
    _run(rt, gamma, "static", 3)
    assert matched == []
    if gamma:
        _run(rt, gamma, "eager", 3)
        assert matched


@pytest.mark.parametrize("batch", [1, 3])
def test_a_greedy_static_step_launches_the_next_draft_chain_ahead(rt, batch):
    """A greedy static engine launches the next step's draft chain before the step's read, from the
    verify's device verdict (speculate._draft_ahead), and the next step takes it. A sequence ending
    on an EOS leaves the others their rows of it (batch 3); a request admitted into its slot has
    none, so that chain is dropped and the step drafts as usual (batch 1). Tokens and acceptance
    equal the eager engine's."""
    eos = _run(rt, 3, "eager", batch)[0].tokens[6]  # ends request 0 early
    eager = _run(rt, 3, "eager", batch, eos=[eos])
    launched, taken = [], []

    def launch(engine, draft_ahead, active, *args):
        ahead = draft_ahead(active, *args)
        if ahead is not None:
            launched.append(len(active))
        return ahead

    with observing(ahead_taken(taken)), observing(Around({"draft_ahead": launch})):
        static = _run(rt, 3, "static", batch, eos=[eos])
    assert [r.tokens for r in static] == [r.tokens for r in eager]
    assert [(r.acceptance.proposed, r.acceptance.accepted) for r in static] == \
        [(r.acceptance.proposed, r.acceptance.accepted) for r in eager]
    assert len(static[0].tokens) == eager[0].tokens.index(eos) + 1 < REQUESTS[0][1]  # the EOS ended it
    if batch == 3:
        assert 3 in taken and 2 in taken  # whole chains, and two sequences' rows of a chain for three
    else:
        assert 0 < len(taken) < len(launched)  # the chain launched at the EOS was dropped


def test_static_sampling_and_ceiling_equal_eager(rt):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3)
    eager = _run(rt, 2, "eager", 3, params, alloc="ceiling")
    static = _run(rt, 2, "static", 3, params, alloc="ceiling")
    assert [r.tokens for r in static] == [r.tokens for r in eager]


def test_tables_are_as_wide_as_the_run_needs_and_grow_by_rebuilding(rt):
    """The graphs' tables span the longest reservation of the call (blocks, rounded up to a power of
    two), not --max-seq-len: a whole-table read then costs what the sequences need. A later call
    with a longer sequence rebuilds them wider; its tokens equal the eager engine's."""
    pools = rt.make_pools(128, 1, block_size=4)
    short, long = Request([3, 17, 99, 4, 250], 6), Request(list(range(10, 40)), 40)

    def engine_for(mode):
        return make_engine(rt, pools, EngineConfig(gamma=2, max_seq_len=128, eos_ids=(), graphs=mode))

    static, eager = engine_for("static"), engine_for("eager")
    try:
        assert static.generate([short])[0].tokens == eager.generate([short])[0].tokens
        need = -(-static.admission.reserve_tokens(short) // 4)
        assert static.runner.graphs.max_blocks == 1 << (need - 1).bit_length() < 128 // 4
        first = static.runner.graphs
        assert static.generate([long])[0].tokens == eager.generate([long])[0].tokens
        assert static.runner.graphs is not first
        assert static.runner.graphs.max_blocks >= -(-static.admission.reserve_tokens(long) // 4)
    finally:
        static.close()
    assert not any(pools.blocks_held().values())


def test_sequences_finishing_early_are_retired_to_scratch(rt):
    """A sequence that ends (EOS) while others run: its table rows point at the scratch block
    before its blocks are freed, and the other sequences' tokens do not change."""
    eos_tok = _run(rt, 2, "eager", 1)[1].tokens[3]  # request 1 emits this early
    eager = _run(rt, 2, "eager", 3, eos=[eos_tok])
    pools = rt.make_pools(128, 3, block_size=4)
    engine = make_engine(rt, pools, EngineConfig(gamma=2, max_seq_len=128, eos_ids=(eos_tok,), check_invariants=True, graphs="static"))
    retired = []
    real_retire = EngineGraphs.retire

    def spy(self, slot):
        held = {n: set(p._held) for n, p in pools.pools.items()}
        real_retire(self, slot)
        for t in [t for owner in self.tables.values() for t in owner.values()]:
            assert bool((t.table[slot] == t.scratch).all())
        retired.append((slot, held))

    EngineGraphs.retire = spy
    try:
        res = engine.generate([Request(p, n, i) for i, (p, n) in enumerate(REQUESTS)], batch_size=3)
    finally:
        EngineGraphs.retire = real_retire
    assert [r.tokens for r in res] == [r.tokens for r in eager]
    assert any(r.finish_reason == "eos" for r in res)
    engine.close()
    assert retired and not any(pools.blocks_held().values())
    # retire ran while the sequence still held its blocks (so before they were freed)
    slot, held = retired[0]
    assert any(held.values())


def check_seats(rt, requests: list[tuple[list[int], int]], slots: int) -> None:
    """An admission seats its sequences in one copy (EngineGraphs.occupy): after each schedule,
    every seated slot's row of every table names its sequence's blocks, scratch past them, and its
    slot indices name its state slots (GLM-5-Next's test calls this too)."""
    from glm5mtp_cli.engine.hooks import watch

    pools = rt.make_pools(128, slots, block_size=4)
    engine = make_engine(rt, pools, EngineConfig(gamma=2, max_seq_len=128, eos_ids=(), check_invariants=True, graphs="static"))
    seated = set()

    def checked(engine, schedule, run):
        active = schedule(run)
        for seq in active:
            caches = {"target": seq.cache, "drafter": seq.state.cache}
            for owner, cache in caches.items():
                for name, t in engine.runner.graphs.tables.get(owner, {}).items():
                    blocks, row = cache.rows[name].blocks, t.table[seq.slot].tolist()
                    assert row == blocks + [t.scratch] * (len(row) - len(blocks)), (owner, name)
                for name, index in engine.runner.graphs.slot_index.get(owner, {}).items():
                    assert int(index.index[seq.slot]) == cache.slots[name].slot, (owner, name)
            seated.add((seq.req.request_id, seq.slot))
        return active

    watch(engine, Around({"schedule": checked}))
    engine.generate([Request(p, n, i) for i, (p, n) in enumerate(requests)], batch_size=slots)
    engine.close()
    assert {r for r, _ in seated} == set(range(len(requests))) and {s for _, s in seated} == set(range(slots))


def test_seated_sequences_table_rows_name_their_blocks(rt):
    check_seats(rt, REQUESTS, 2)


def test_copy_ints_many_writes_whole_tensors_and_chosen_rows():
    from glm5mtp_cli.core.host_copy import copy_ints_many

    table, index, flat = torch.zeros(4, 3, dtype=torch.long), torch.zeros(4, dtype=torch.long), torch.zeros(2, 2, dtype=torch.long)
    copy_ints_many([(table, [2, 0], [1, 2, 3, 4, 5, 6]), (index, [3], [9]), (flat, None, [7, 8, 9, 10])])
    assert table.tolist() == [[4, 5, 6], [0, 0, 0], [1, 2, 3], [0, 0, 0]]
    assert index.tolist() == [0, 0, 0, 9]
    assert flat.tolist() == [[7, 8], [9, 10]]
    copy_ints_many([])  # nothing to write: no copy


def test_cuda_graphs_need_cuda(rt):
    pools = rt.make_pools(64, 1, block_size=4)
    with pytest.raises(UserError, match="CUDA graphs need --device cuda"):
        make_engine(rt, pools, EngineConfig(gamma=1, max_seq_len=64, graphs="cuda"))


def test_graph_mode_captures_under_tp_on_cuda(rt):
    """--tp on CUDA captures (the NCCL collectives go inside the graphs); gloo on the CPU stays eager."""
    from dataclasses import replace

    from glm5mtp_cli.core.parallel import Comm
    from glm5mtp_cli.engine.runtime import graph_mode

    on_cuda = replace(rt, comm=Comm(0, 2), device=torch.device("cuda"))
    assert graph_mode(on_cuda, True) == "cuda"
    assert graph_mode(on_cuda, False) == "eager"
    assert graph_mode(replace(rt, comm=Comm(0, 2)), True) == "eager"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_equal_eager_on_gpu(spec_ckpt):
    folder, _ = spec_ckpt
    resolved = resolve_model(str(folder), progress=False)
    target, mtp, _ = load_models(resolved, "cuda", torch.float32)
    grt = Runtime(resolved, resolved.config, target.eval(), mtp.eval(), None, torch.device("cuda"), torch.float32)
    for gamma in (0, 3):
        def run(mode):
            pools = grt.make_pools(128, 3, block_size=4)
            e = make_engine(grt, pools, EngineConfig(gamma=gamma, max_seq_len=128, eos_ids=(), graphs=mode))
            out = e.generate([Request(p, n, i) for i, (p, n) in enumerate(REQUESTS)], batch_size=3)
            e.close()
            assert not any(pools.blocks_held().values())
            return [r.tokens for r in out]
        assert run("cuda") == run("eager")


@pytest.mark.parametrize("gamma", [0, 3])
def test_graph_bytes_prediction_equals_the_buffers(rt, gamma):
    """profile's cuda_graphs component: what a one-slot engine's graphs keep allocated (static
    inputs, tables as wide as the engine makes them for the request, and the outputs a capture
    owns), predicted from the config, equals the buffers EngineGraphs builds."""
    from glm5mtp_cli.diagnostics.sizing import graph_bytes

    pools = rt.make_pools(128, 1, block_size=4)
    engine = make_engine(rt, pools, EngineConfig(gamma=gamma, max_seq_len=128, eos_ids=(), graphs="static"))
    req = Request(list(range(10, 40)), 20)
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
        out, verdict = bucket.verify[VerifyPlan.chain(gamma)].run()
        held += out.logits.nbytes + out.hidden_all.nbytes + verdict.nbytes  # `hidden` shares hidden_all's storage
        if gamma:
            held += bucket.draft[gamma].run().nbytes
        assert held == graph_bytes(rt.cfg, torch.float32, engine.admission.reserve_tokens(req), 4, gamma, 128)
    finally:
        engine.close()
        engine.lifecycle.release(seq)
    assert not any(pools.blocks_held().values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_runner_pool_stays_open_when_its_graphs_are_rebuilt():
    """A graph set rebuilt while a tensor its capture allocated is still held (leak-check's rounds
    rebuild for stepwise drafting): with the runner's anchor, the next capture into its pool finds
    it open (without, PyTorch's allocator asserts use_count > 0 at capture_begin)."""
    runner = ForwardRunner("cuda", torch.device("cuda"))
    x = torch.ones(4, device="cuda")
    first = torch.cuda.CUDAGraph()
    with torch.cuda.graph(first, pool=runner.mempool):
        held = x * 2  # allocated from the pool
    first.replay()
    del first  # the pool's graph gone, `held` still alive
    second = torch.cuda.CUDAGraph()
    with torch.cuda.graph(second, pool=runner.mempool):
        out = held + 1
    second.replay()
    assert torch.equal(out, torch.full_like(x, 3.0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernels_in_the_model_match_the_cpu_reference(rt, spec_ckpt):
    """On CUDA the forward takes the Triton RMSNorm, rope and MoE kernels; in fp32 its logits equal
    the CPU (pure PyTorch) forward's."""
    from glm5mtp_cli.engine.cache import CachePools

    folder, _ = spec_ckpt
    resolved = resolve_model(str(folder), progress=False)
    target, _, _ = load_models(resolved, "cuda", torch.float32)
    ids = torch.tensor([REQUESTS[2][0]])
    outs = []
    for model, dev in ((rt.target, "cpu"), (target.eval(), "cuda")):
        pools = CachePools.create(rt.cfg, 16, 4, torch.float32, dev, with_drafter=False)
        outs.append(model(ids.to(dev), [pools.target_cache()]).logits.cpu())
    rel = ((outs[1] - outs[0]).norm() / outs[0].norm()).item()
    assert rel < 1e-4, rel


@pytest.mark.parametrize("gamma", [0, 3])
def test_paged_kernel_path_equals_the_torch_path(rt, gamma, monkeypatch):
    """The CUDA attention path (kernels/paged.py: indexer scores and MLA attention read the pools
    in place), taken on the CPU through the kernels' PyTorch references: same tokens, and drafts
    accepted alike, as the gathered torch path (prompts longer than index_topk: selection active)."""
    from glm5mtp_cli.checkpoint.resolve import resolve_config
    from glm5mtp_cli.models.glm5.attention import MLAttention

    # which models take it on CUDA: small selections (glm5-nano, 128 keys), not GLM-5's 2048
    limit = MLAttention.PAGED_MAX_TOPK
    assert resolve_config("glm5")[0].index_topk > limit >= resolve_config("glm5-nano")[0].index_topk

    want = _run(rt, gamma, "eager", 3)
    monkeypatch.setattr(MLAttention, "use_paged_kernels", lambda self, x: not torch.is_grad_enabled())
    got = _run(rt, gamma, "eager", 3)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert [r.acceptance.accepted for r in got] == [r.acceptance.accepted for r in want]
    static = _run(rt, gamma, "static", 3)
    assert [r.tokens for r in static] == [r.tokens for r in want]


def test_a_feed_pads_each_sequences_rows_into_its_row():
    """Feed.of: each sequence's rows in its own row of one tensor, counts kept; the runner's load of
    a feed writes row j's first counts[j] into its buffer row and leaves the padding rows alone."""
    from glm5mtp_cli.engine.graphs import ForwardRunner
    from glm5mtp_cli.engine.proposer import Feed
    from glm5mtp_cli.engine.static import StaticForward

    source = torch.arange(24).view(4, 6).clone()
    views = [source[j, : j + 1] for j in range(3)]  # each sequence's first a_j + 1 rows, in order
    feed = Feed.of([(v, v[:, None].float()) for v in views])
    assert len(feed) == 3 and feed.counts == [1, 2, 3]
    for j, v in enumerate(views):
        assert torch.equal(feed.tokens[j, : v.shape[0]], v)
    f = StaticForward(None, None, 4, 8, {}, torch.device("cpu"), (1, torch.float32), pick_row=True)
    f.ids.fill_(-1)
    ForwardRunner("static", torch.device("cpu"))._load(f, Feed(source[:3], source[:3, :, None].float(), [1, 3, 2]),
                                                        [], [0, 0, 0], "test")
    for j, n in enumerate([1, 3, 2]):
        assert torch.equal(f.ids[j, :n], source[j, :n])
    assert (f.ids[3] == -1).all() and f.rows.tolist() == [0, 2, 1, 0]


def test_a_changed_batch_gathers_its_rows_by_the_step_they_came_from():
    """Feed.gather: rows of one step's tensors (out of order, some gone) and rows of their own (an
    admitted sequence's) land in order, each row's first n exactly; past n a row holds what followed
    it in its step's tensors, or zeros."""
    from glm5mtp_cli.engine.proposer import Feed
    from glm5mtp_cli.engine.sequence import BatchRow

    step = (torch.arange(20).view(5, 4) + 100, torch.arange(40.0).view(5, 4, 2))
    narrow = (torch.arange(6).view(3, 2) + 10, torch.arange(12.0).view(3, 2, 2))  # a step of gamma 1
    own = BatchRow.own(torch.tensor([7]), torch.tensor([[0.5, 0.25]]))
    rows = [BatchRow(step, 3, 2), own, BatchRow(narrow, 2, 2), BatchRow(step, 0, 4), BatchRow(narrow, 0, 1),
            BatchRow(step, 4, 1)]
    feed = Feed.gather(rows)
    assert feed.counts == [2, 1, 2, 4, 1, 1] and feed.tokens.shape == (6, 4) and feed.hiddens.shape == (6, 4, 2)
    for j, r in enumerate(rows):
        t, h = r.tensors()
        assert torch.equal(feed.tokens[j, : r.n], t) and torch.equal(feed.hiddens[j, : r.n], h)
    assert torch.equal(feed.tokens[0], step[0][3]) and torch.equal(feed.hiddens[5], step[1][4])
    for j in (1, 2, 4):  # past their own tensors' width: zeros
        w = rows[j].src[0].shape[1]
        assert feed.tokens[j, w:].eq(0).all() and feed.hiddens[j, w:].eq(0).all()


def test_a_fused_chain_returns_the_batch_drafts_as_one_tensor(rt):
    """Static forwards, greedy: a propose returns the fused chain's [A, g] output as one
    Drafts (no per-sequence views), every state's last_drafts is it, a row read from it is that
    sequence's DraftChain, and the tokens are eager's."""
    from glm5mtp_cli.engine.proposer import Drafts

    seen = []

    def spy(engine, propose, feed, states, g, masks):
        out = propose(feed, states, g, masks)
        seen.append(out)
        if isinstance(out, Drafts):
            assert all(st.last_drafts is out for st in states) and len(out) == len(states)
            assert out.tokens.shape == (len(states), g) and torch.equal(out[len(states) - 1].tokens, out.tokens[-1])
            assert out[0].num_drafts == g and out[0].probs is None
        return out

    with observing(Around({"propose": spy})):
        static = _run(rt, 3, "static", 2)
    assert seen and all(isinstance(c, Drafts) for c in seen)
    assert [r.tokens for r in static] == [r.tokens for r in _run(rt, 3, "eager", 2)]


def test_an_unchanged_batch_feeds_the_drafter_its_last_step_as_one_tensor(rt, monkeypatch):
    """After a drafting step the batch's pending rows stay one tensor (the last verify's drafter
    feed) into the next draft; once the batch changes (a sequence finished, one was admitted) its
    rows are gathered into a feed (Feed.gather). Both paths run here, and the tokens are eager's
    (test_static_forwards_equal_eager)."""
    from glm5mtp_cli.engine.proposer import Feed

    kinds, gathered, real_gather = [], [], Feed.gather

    def spy(engine, propose, feed, *args):
        kinds.append(feed not in gathered)
        return propose(feed, *args)

    def gather(rows):
        feed = real_gather(rows)
        gathered.append(feed)
        return feed

    monkeypatch.setattr(Feed, "gather", staticmethod(gather))
    with observing(Around({"propose": spy})):
        static = _run(rt, 3, "static", 2)
    assert True in kinds and False in kinds, kinds
    monkeypatch.undo()
    assert [r.tokens for r in static] == [r.tokens for r in _run(rt, 3, "eager", 2)]