"""GLM-5-Next's batched fixed-shape forwards over the pools (models/glm5_next/paged.py) against the
one-sequence reference (tests/glm5next_reference.py: forward_rows over a SequenceState / IndexedSlot,
commit), fp32 CPU:
the same logits (1e-5 relative) and, after partial accepts, the same KDA states, conv windows,
latent rows, pooled keys and raw tails. The context is built as a graph runner builds it: tables
as wide as a fixed width with a scratch block, a padding row on a scratch slot, inside sync_free();
on the meta device the forwards run without any host read or data-dependent shape."""

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from glm5next_oracle import hf_model, write_checkpoint  # noqa: E402
from glm5next_reference import Mtp, Target, boundary_ties  # noqa: E402
from proposer_calls import prefill_drafter  # noqa: E402

from glm5mtp_cli.engine.config import EngineConfig
from glm5mtp_cli.core.cached import CachedRows, CachedSlots  # noqa: E402
from glm5mtp_cli.core.host_copy import to_device  # noqa: E402
from glm5mtp_cli.engine.cache import CachePools  # noqa: E402
from kernels.table_slots import table_slots  # noqa: E402
from glm5mtp_cli.errors import UserError  # noqa: E402
from glm5mtp_cli.engine.mtp_head import mtp_proposer  # noqa: E402
from glm5mtp_cli.core.sync_free import sync_free  # noqa: E402
from glm5mtp_cli.models.glm5_next.indexer import pool_scores  # noqa: E402
from glm5mtp_cli.models.glm5_next.load import load_next  # noqa: E402
from glm5mtp_cli.models.glm5_next.pooled import PooledMtp, PooledTarget  # noqa: E402

BS = 4           # block size of the test pools (one pool of P = 4 rows per block)
WIDTH = 16       # table width in blocks (64 rows), as a runner's fixed max_seq_len tables
PROMPTS = [13, 22, 30]  # 3, 5 and 7 complete pools: more than index_topk / P = 2, so selection is active


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = write_checkpoint(hf_model(seed=2), tmp_path_factory.mktemp("glm5next_batched"))
    cfg, target, mtp = load_next(folder, torch.float32)
    assert cfg.index_n_heads >= 16 and cfg.index_topk // cfg.index_kpool < min(PROMPTS) // cfg.index_kpool
    drafter = PooledMtp(mtp)
    drafter.share_topk = False
    return cfg, PooledTarget(target), drafter


class Static:
    """What a graph runner holds for one owner's batch: [B, WIDTH] tables padded with a scratch
    block, a scratch slot per slot component, and rows past `caches` on those scratch entries."""

    def __init__(self, pools: CachePools, owner: str, caches: list, pad: int, device="cpu"):
        self.caches, self.pad, self.device = caches, pad, device
        self.scratch = {n[len(owner) + 1:]: pools.pools[n].take(1)[0] for n in pools.owners[owner]
                        if n[len(owner) + 1:] in caches[0].rows}
        scratch_slot = {name: ref.pool.take() for name, ref in caches[0].slots.items()}
        self.slot_index = {name: to_device([c.slots[name].slot for c in caches] + [scratch_slot[name]] * pad, device)
                           for name in scratch_slot}
        self.tables = {}
        for name, block in self.scratch.items():
            table = torch.full((len(caches) + pad, WIDTH), block, dtype=torch.long, device=device)
            for b, c in enumerate(caches):
                table[b, : len(c.rows[name].blocks)] = torch.tensor(c.rows[name].blocks)
            self.tables[name] = table

    def starts(self) -> torch.Tensor:
        return to_device([c.length for c in self.caches] + [0] * self.pad, self.device)

    def context_at(self, model):
        def context(starts: torch.Tensor, t: int):
            rows = {}
            for name, table in self.tables.items():
                new, all_ = table_slots(table, BS, starts, t, self.scratch[name])
                rows[name] = CachedRows(self.caches[0].rows[name].pool.data, new, all_)
            slots = {name: CachedSlots(self.caches[0].slots[name].pool.data, index)
                     for name, index in self.slot_index.items()}
            return model.context(starts, t, rows, slots)
        return context


def _pools(cfg, device="cpu"):
    return CachePools.create(cfg, num_blocks=96, block_size=BS, dtype=torch.float32, device=device)


def _rel(a, b) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).abs().max() / b.abs().max())


def _compare_state(cfg, cache, ref, tol: float):
    """Every component of one pooled sequence equals the reference's SequenceState `ref`."""
    P, n = cfg.index_kpool, ref.length
    assert cache.length == n
    for j, i in enumerate(cfg.kda_layers):
        assert _rel(cache.slots["kda"].pool.data[j, cache.slots["kda"].slot], ref.kda[i].state) < tol
        assert _rel(cache.slots["conv"].pool.data[j, cache.slots["conv"].slot], ref.kda[i].window) < tol
    for j, i in enumerate(cfg.indexed_layers):
        def read(name, a, z):
            r = cache.rows[name]
            blocks = torch.tensor(r.blocks, device=r.pool.data.device)
            pos = torch.arange(a, z, device=blocks.device)
            return r.pool.data[j].index_select(0, blocks[pos // BS] * BS + pos % BS)
        slot = ref.indexed[i]
        assert _rel(read("mla", 0, n), slot.latent[:n]) < tol
        assert _rel(read("pool", 0, n // P * P).reshape(n // P, -1), slot.pooled[: n // P]) < tol
        if n % P:
            assert _rel(read("raw", n // P * P, n), slot.tail[: n % P]) < tol


def capture(fn):
    """fn() captured as a CUDA graph after a warm-up on a side stream: (graph, its outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), sync_free():
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), sync_free():
        out = fn()
    return graph, out


def _target_steps(models, batch: int, device: str, graphs: bool, tol: float):
    """Verify (T = gamma + 1 = 4) and decode (T = 1) steps with per-sequence partial accepts through
    the static forward (captured when `graphs`) on `device`, against the CPU per-sequence path."""
    cfg, target, _ = models
    model = Target(target.model)
    pooled = target if device == "cpu" else copy.deepcopy(target).to(device)
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=g) for n in PROMPTS[:batch]]
    pools = _pools(cfg, device)
    caches, refs = [], []
    for p in prompts:
        cache = pools.target_cache()
        cache.reserve(60)
        out = pooled(p[None].to(device), [cache], rows="last")  # eager prefill through the same batched path, B = 1
        pooled.commit(out.pending, torch.tensor([len(p)], device=device))
        ref = model.new_state(64)
        model.prefill(p, ref)
        caches.append(cache)
        refs.append(ref)
    static = Static(pools, "target", caches, pad=1, device=device)
    context_at = static.context_at(pooled)
    starts = torch.zeros(batch + 1, dtype=torch.long, device=device)
    forwards = {}  # t -> (ids buffer, run)
    ties = 0
    # (rows, kept per sequence): partial accepts, a reject-all, a full accept, a decode step
    for t, keeps in ((4, [2, 1, 3]), (1, [1, 1, 1]), (4, [4, 3, 1]), (4, [1, 2, 4]), (4, [3, 4, 2])):
        ids = torch.randint(2, cfg.vocab_size, (batch + 1, t), generator=g)
        for c in caches:
            c.prepare(t)  # as a runner does before a run
        starts.copy_(static.starts())
        if t not in forwards:
            buf = torch.zeros(batch + 1, t, dtype=torch.long, device=device)
            fn = lambda buf=buf, t=t: pooled.forward_batch(buf, context_at(starts, t), "all")  # noqa: E731
            if graphs:
                buf.copy_(ids)
                graph, out = capture(fn)
                forwards[t] = (buf, lambda graph=graph, out=out: (graph.replay(), out)[1])
            else:
                forwards[t] = (buf, fn)
        buf, run = forwards[t]
        buf.copy_(ids)
        with sync_free():
            out = run()
        pooled.commit(out.pending, torch.tensor(keeps[:batch] + [0], device=device))  # the padding row keeps none
        for b, (cache, ref) in enumerate(zip(caches, refs)):
            logits, _, pending = model.verify(ids[b], ref)
            assert _rel(out.logits[b], logits) < tol, (t, b)
            for i, p in pending.layers.items():
                if getattr(p, "scores", None) is not None:
                    visible = (ref.length + 1 + torch.arange(t)) // cfg.index_kpool
                    ties += int(boundary_ties(p.scores, visible, cfg.index_topk // cfg.index_kpool, tol).sum())
            model.commit(ref, pending, keeps[b])
            cache.length += t
            cache.truncate(ref.length)
            _compare_state(cfg, cache, ref, tol)
    assert ties == 0, "a top-k boundary tie makes the selection order-dependent"
    for c in caches:
        c.release()


@pytest.mark.parametrize("batch", [1, 3])
def test_static_target_steps_equal_per_sequence_path(models, batch):
    _target_steps(models, batch, "cpu", graphs=False, tol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch", [1, 3])
def test_cuda_graph_target_steps_equal_per_sequence_path(models, batch):
    """The same steps replayed from CUDA graphs captured once per T (fp32 on the GPU, TF32 off)."""
    _target_steps(models, batch, "cuda", graphs=True, tol=1e-4)


def test_padding_rows_touch_no_real_state(models):
    """A padding row (scratch table row, scratch slot) beside a real one leaves the real sequence's
    state and logits as they are alone, and changes no other held block or slot."""
    cfg, target, _ = models
    g = torch.Generator().manual_seed(7)
    p = torch.randint(2, cfg.vocab_size, (22,), generator=g)
    ids = torch.randint(2, cfg.vocab_size, (1, 4), generator=g)
    outs = []
    for pad in (0, 2):
        pools = _pools(cfg)
        cache = pools.target_cache()
        cache.reserve(40)
        target.commit(target(p[None], [cache], rows="last").pending, torch.tensor([len(p)]))
        static = Static(pools, "target", [cache], pad=pad)
        cache.prepare(4)
        before = {n: pool.data.clone() for n, pool in pools.pools.items()}
        batch_ids = torch.cat([ids, ids.new_full((pad, 4), 3)])
        with sync_free():
            out = target.forward_batch(batch_ids, static.context_at(target)(static.starts(), 4), "all")
        for name, pool in pools.pools.items():
            changed = (pool.data != before[name]).flatten(2).any(-1).any(0)  # [rows] or [slots]
            short = name[len("target_"):]
            if short not in static.tables:
                assert not changed.any(), name  # KDA state is written only by the commit
                continue
            blocks = set(static.tables[short][0].tolist()) | {static.scratch[short]}
            allowed = torch.zeros_like(changed)
            for blk in blocks:
                allowed[blk * BS:(blk + 1) * BS] = True
            assert not (changed & ~allowed).any(), name
        target.commit(out.pending, torch.tensor([2] + [0] * pad))
        cache.length += 4
        cache.truncate(cache.length - 2)
        outs.append((out.logits[0], pools.pools["target_kda"].data[:, cache.slots["kda"].slot].clone()))
    assert _rel(outs[1][0], outs[0][0]) < 1e-5 and _rel(outs[1][1], outs[0][1]) < 1e-5


def _greedy_chain(models, device: str, graphs: bool, share: bool = False):
    """MtpHead.greedy_chain (the fused draft forward a runner captures) over padded catch-up feeds of
    1, 3 and 2 real rows (a padding row beside them) against the one-sequence reference chain on the CPU;
    share: index_share_for_mtp_iteration (chain steps reuse each sequence's step-0 selection)."""
    cfg, target, mtp = models
    embed, lm_head = target.model.embed_tokens, target.model.lm_head
    ref = Mtp(mtp.layer)
    on_dev = (target, mtp) if device == "cpu" else (copy.deepcopy(target).to(device), copy.deepcopy(mtp).to(device))
    g = torch.Generator().manual_seed(5)
    gamma = 4
    seqs = [(torch.randint(2, cfg.vocab_size, (n,), generator=g), torch.randn(n, cfg.hidden_size, generator=g), f)
            for n, f in ((27, 1), (31, 3), (22, 2))]
    pools = _pools(cfg, device)
    on_dev[1].share_topk = share
    head = mtp_proposer(cfg, *on_dev, pools, EngineConfig(max_seq_len=64))
    states = [head.alloc_state_for(48) for _ in seqs]
    refs = []
    for st, (tok, hid, f) in zip(states, seqs):
        prefill_drafter(head, tok[:-f].to(device), hid[:-f].to(device), st)
        slot = ref.new_state(64)
        ref.prefill(tok[:-f], hid[:-f], slot, embed, lm_head)
        if f > 1:  # the pending real rows before the last one, then the chain from the last
            ref.catchup(tok[-f:-1], hid[-f - 1:-2], slot, embed, lm_head)
        refs.append(ref.propose(tok[-1], hid[-2], slot, gamma, embed, lm_head, share_topk=share).tokens)
    static = Static(pools, "drafter", [st.cache for st in states], pad=1, device=device)
    ids = torch.zeros(len(seqs) + 1, gamma + 1, dtype=torch.long, device=device)
    hidden = torch.zeros(len(seqs) + 1, gamma + 1, cfg.hidden_size, device=device)
    last = torch.zeros(len(seqs) + 1, dtype=torch.long, device=device)
    starts = static.starts()
    for b, (tok, hid, f) in enumerate(seqs):
        ids[b, :f], hidden[b, :f], last[b] = tok[-f:], hid[-f - 1:-1], f - 1

    def fn():
        return head.greedy_chain(ids, hidden, starts, last, static.context_at(on_dev[1]), gamma)

    try:
        if graphs:
            graph, drafts = capture(fn)
            graph.replay()
        else:
            with sync_free():
                drafts = fn()
    finally:
        on_dev[1].share_topk = False
    for b, ref in enumerate(refs):
        assert torch.equal(drafts[b].cpu(), ref), b
    for st in states:
        head.free_state(st)
    return refs


def test_static_greedy_chain_equals_model_chain(models):
    own = _greedy_chain(models, "cpu", graphs=False)
    shared = _greedy_chain(models, "cpu", graphs=False, share=True)
    assert any(not torch.equal(a, b) for a, b in zip(own, shared)), "sharing must change a draft here"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("share", [False, True])
def test_cuda_graph_greedy_chain_equals_model_chain(models, share):
    _greedy_chain(models, "cuda", graphs=True, share=share)


def test_forwards_read_nothing_on_the_host(models):
    """On the meta device any host read (.item(), .tolist(), int(), bool()) or data-dependent shape
    (nonzero, masked select, bincount) raises: the target and drafter forwards run there whole."""
    cfg, target, mtp = models
    target, mtp = copy.deepcopy(target).to("meta"), copy.deepcopy(mtp).to("meta")
    mtp._step0_rows = None  # a selection an earlier test's static chain left on the copied layer
    pools = _pools(cfg, "meta")
    for owner, model in (("target", target), ("drafter", mtp)):
        caches = [pools.sequence_cache(owner) for _ in range(2)]
        for c in caches:
            c.reserve(40)
        static = Static(pools, owner, caches, pad=1, device="meta")
        ids = torch.zeros(3, 4, dtype=torch.long, device="meta")
        with sync_free():
            ctx = static.context_at(model)(static.starts(), 4)
            if owner == "target":
                out = model.forward_batch(ids, ctx, "all")
                rows = out.pending.rows
                assert len(rows) == len(cfg.kda_layers) and all(r.q.shape[:2] == (3, 4) for r in rows)
            else:
                hidden = torch.zeros(3, 4, cfg.hidden_size, device="meta")
                out = model.forward_batch(ids, hidden, ctx, target.model.embed_tokens, target.model.lm_head,
                                          torch.zeros(3, dtype=torch.long, device="meta"))
                mtp.share_topk = True  # step 0 keeps its selection on the device, chained steps reuse it
                with mtp.chained(), pytest.raises(UserError, match="step-0 pool selection"):
                    model.forward_batch(ids, hidden, ctx, target.model.embed_tokens, target.model.lm_head, "last")
                model.forward_batch(ids, hidden, ctx, target.model.embed_tokens, target.model.lm_head, "last")
                with mtp.chained():
                    model.forward_batch(ids[:, :1], hidden[:, :1], static.context_at(model)(static.starts(), 1),
                                        target.model.embed_tokens, target.model.lm_head, "last")
                mtp.share_topk = False
        assert out.logits.shape == (3, 4 if owner == "target" else 1, cfg.vocab_size)


def test_pool_scores_batch_equals_per_sequence():
    """pool_scores over a batch equals each sequence's own scores (the einsum's leading dims)."""
    g = torch.Generator().manual_seed(0)
    q, w, pooled = torch.randn(3, 2, 16, 8, generator=g), torch.randn(3, 2, 16, generator=g), torch.randn(3, 5, 8, generator=g)
    batched = pool_scores(q, w, pooled)
    for b in range(3):
        assert torch.allclose(batched[b], pool_scores(q[b], w[b], pooled[b]), rtol=1e-6, atol=1e-6)


def test_tables_narrower_than_a_pool(models):
    """Blocks of 2 rows (< P = 4): the first decode steps read a table with no whole pool."""
    cfg, target, _ = models
    pools = CachePools.create(cfg, num_blocks=32, block_size=2, dtype=torch.float32, device="cpu")
    cache = pools.target_cache()
    cache.reserve(16)
    model = Target(target.model)
    ref = model.new_state(16)
    tokens = torch.randint(2, cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(1))
    for tok in tokens:
        out = target(tok.view(1, 1), [cache], "all")
        target.commit(out.pending, torch.ones(1, dtype=torch.long))
        assert _rel(out.logits[0], model.decode(tok, ref)[0]) < 1e-5
    cache.release()
