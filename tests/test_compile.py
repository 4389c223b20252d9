"""--compile (engine/compiled.py): the engine's static forwards through torch.compile (inductor on the
CPU, fp32) give the eager engine's greedy tokens, in one graph each; the kernels' custom ops pass
torch.library.opcheck; a bad value is one line and exit 2.

The GLM-5 runs take the kernels' branch on the CPU (kernel path "all"): the forwards then call every
custom op the CUDA path calls, each running its PyTorch reference. Models are cut to two layers (one
of each kind) to keep inductor's CPU compiles (C++, ~5-20 s per forward here) few and small.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from glm5mtp_cli.engine.config import ModelSpec, EngineConfig
from glm5mtp_cli.engine.cache import CachePools
from glm5mtp_cli.core.cached import write_rows
from glm5mtp_cli.engine.compiled import compile_forward
from glm5mtp_cli.engine.static import sequences_forward
from glm5mtp_cli.engine.runtime import load_runtime, make_engine
from glm5mtp_cli.engine.sequence import Request
from kernels import fp8_block, moe, moe_grouped, paged, pool_keys, rmsnorm, rope, router, swiglu
from kernels._triton import kernel_path

pytestmark = pytest.mark.compile  # inductor's C++ compiles: minutes cold, the second test command

PROMPTS = [([3, 17, 99, 4, 250, 8, 61, 7, 12, 90], 10)]


@pytest.fixture(scope="module")
def glm5(tmp_path_factory):
    from glm5mtp_cli.checkpoint.write import init_random

    out = tmp_path_factory.mktemp("glm5_tiny")
    init_random("glm5-tiny", out, seed=1, dtype=torch.float32)
    return load_runtime(ModelSpec(str(out), "cpu", "fp32", layers=2), progress=False)  # a dense and a MoE layer


@pytest.fixture(scope="module")
def glm5_fp8(tmp_path_factory):
    """glm5-tiny with FP8 weights in 16-row blocks: its projections of one input load joined (models/fp8.join_inputs)."""
    from glm5mtp_cli.checkpoint.write import init_random
    from glm5mtp_cli.models.fp8 import FP8_QUANT_CONFIG

    out = tmp_path_factory.mktemp("glm5_tiny_fp8")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(FP8_QUANT_CONFIG, "weight_block_size", [16, 16])
        init_random("glm5-tiny", out, seed=1, dtype=torch.float32, fp8=True)
    rt = load_runtime(ModelSpec(str(out), "cpu", "fp32", layers=2), progress=False)
    assert "joined_x_weight" in rt.target.model.layers[0].self_attn._buffers
    return rt


@pytest.fixture(scope="module")
def glm5next(tmp_path_factory):
    from glm5mtp_cli.checkpoint.write import init_random

    out = tmp_path_factory.mktemp("glm5next_tiny")
    init_random("glm5next-tiny", out, seed=1, dtype=torch.float32)
    return load_runtime(ModelSpec(str(out), "cpu", "fp32", layers=2), progress=False)  # a KDA and an indexed MLA layer


def _tokens(rt, gamma, mode, compile="off"):
    pools = rt.make_pools(48, 1, block_size=4)
    engine = make_engine(rt, pools, EngineConfig(gamma=gamma, max_seq_len=48, eos_ids=(), graphs=mode, compile=compile, check_invariants=True))
    try:
        res = engine.generate([Request(p, n, i) for i, (p, n) in enumerate(PROMPTS)], batch_size=1)
    finally:
        engine.close()
    assert not any(pools.blocks_held().values())
    if compile != "off":
        assert engine.runner.compile_s > 0
    return [r.tokens for r in res]


@pytest.mark.parametrize("family, compile, path, gamma", [
    *[(f, c, p, g) for f, c, p in [("glm5", "kernels", "all"), ("glm5next", "torch", "cuda")] for g in (0, 2)],
    ("glm5_fp8", "kernels", "all", 2),  # FP8 Linears, joined ones among them, as custom ops
    ("glm5next", "kernels", "all", 2)])  # mHC and KDA kernels as custom ops
def test_compiled_forwards_equal_eager(request, family, compile, path, gamma):
    rt = request.getfixturevalue(family)
    counters.clear()
    with kernel_path(path):
        eager = _tokens(rt, gamma, "eager")
        compiled = _tokens(rt, gamma, "static", compile)
    assert compiled == eager
    assert not counters["graph_break"], dict(counters["graph_break"])
    # one graph per static forward: gamma 0 a verify; gamma 2 a verify and the fused greedy draft chain
    assert counters["stats"]["unique_graphs"] == (1 if gamma == 0 else 2)


def test_compiled_decode_logits_close(glm5):
    """One decode forward at 9 cached rows: compiled (pure-torch path) against the same forward uncompiled."""
    target = glm5.target
    pools = CachePools.create(glm5.cfg, 4, 4, torch.float32, "cpu", with_drafter=False)
    cache = pools.target_cache()
    cache.reserve(12)
    try:
        for pool in pools.pools.values():
            pool.data.normal_(0, 1, generator=torch.Generator().manual_seed(0))
        f = sequences_forward(target.context, lambda f: target.forward_batch(f.ids, f.context(f.starts, 1), "last"),
                              [cache], 1, torch.device("cpu"))
        f.ids.fill_(5)
        f.set_starts([9])
        want = f.run().logits.clone()
        assert f.compile("torch", "default") > 0
        got = f.run().logits
    finally:
        cache.release()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_own_code_keeps_forwards_apart():
    """Dynamo allows recompile_limit entries per code object: forwards sharing one lambda's code would hit
    it (an error under fullgraph) after that many buckets and gammas; each compiled forward has its own."""
    def make():
        return lambda x: torch.sin(x) + 1  # one code object for every forward made here

    with torch._dynamo.config.patch(recompile_limit=1):
        for n in (2, 3, 4):
            # away from sin(x) = -1, where inductor's vectorized sin differs from eager's by more than
            # allclose's relative tolerance of a value near 0 (random inputs made this test flaky)
            x = torch.linspace(0.0, 1.0, n)
            assert torch.allclose(compile_forward(make())(x), torch.sin(x) + 1)


def test_kernels_lowered_before_compiling(monkeypatch):
    """compile_forward gives inductor every custom op's fallback before it compiles: its own, made at
    an op's first use, costs a minute on torch 2.11 (engine/compiled.lower_kernels_as_fallbacks)."""
    from torch._inductor.lowering import lowerings

    names = [name for name in torch._C._dispatch_get_all_op_names() if name.startswith("glm5mtp::")]
    assert {op._qualname for op, _ in _op_cases().values()} <= set(names)
    ops = [getattr(torch.ops.glm5mtp, name.partition("::")[2]).default for name in names]
    for op in ops:
        monkeypatch.delitem(lowerings, op, raising=False)
    compile_forward(lambda x: x + 1)
    assert [op for op in ops if op not in lowerings] == []


def _fp8(rows, cols, block):
    return fp8_block.fp8_block_quantize(torch.randn(rows, cols), (block, block))


def _op_cases():
    g, t, h, lat, r, n, nl, e, inter, hid = 2, 3, 4, 8, 4, 40, 12, 4, 8, 8
    slots, starts = torch.randint(0, n, (g, nl)), torch.tensor([2, 5])
    w, s = _fp8(32, 48, 16)
    hw, hs = _fp8(4 * 32, 32, 16)
    fp8_stack = [_fp8(inter, hid, 4) for _ in range(e)]
    down_stack = [_fp8(hid, inter, 4) for _ in range(e)]
    gate, gate_s = torch.stack([a for a, _ in fp8_stack]), torch.stack([b for _, b in fp8_stack])
    down, down_s = torch.stack([a for a, _ in down_stack]), torch.stack([b for _, b in down_stack])
    ids, weights = torch.randint(0, e, (3, 2)), torch.rand(3, 2)
    return {
        "rmsnorm": (rmsnorm.rmsnorm_op, (torch.randn(3, 5, 8)[..., :6], torch.randn(6), 1e-6)),
        "rope": (rope.rope_interleaved_op, (torch.randn(4, 2, 8), torch.randn(4, 4), torch.randn(4, 4))),
        "indexer": (paged.indexer_scores_paged_op, (torch.randn(g, t, 2, 8), torch.randn(n, 8), slots, starts,
                                                     torch.randn(g, t, 2), 0.3, 0)),
        "indexer_pooled": (paged.indexer_scores_paged_op, (torch.randn(g, t, 2, 8), torch.randn(n, 2), slots,
                                                            starts, torch.randn(g, t, 2), 0.3, 4)),
        "mla_index": (paged.mla_attention_paged_op, (torch.randn(g, t, h, lat), torch.randn(g, t, h, r),
                                                     torch.randn(n, lat + r), slots, starts,
                                                     torch.randint(-1, 8, (g, t, 5)), 0.3, None, 0, False)),
        "mla_dense": (paged.mla_attention_paged_op, (torch.randn(g, t, h, lat), torch.randn(g, t, h, r),
                                                     torch.randn(n, lat + r), slots, starts, None, 0.3, None, 0, False)),
        "mla_pools": (paged.mla_attention_paged_op, (torch.randn(g, t, h, lat), torch.randn(g, t, h, 0),
                                                     torch.randn(n, lat), slots, starts, None, 0.3,
                                                     torch.rand(g, t, nl // 4) < 0.5, 4, True)),
        "swiglu": (swiglu.swiglu_op, (*torch.randn(3, 16).split(8, dim=-1), 1.5)),
        "swiglu_free": (swiglu.swiglu_op, (torch.randn(2, 3, 6), torch.randn(2, 3, 6), None)),
        "route": (router.route_op, (torch.randn(3, 16), torch.randn(16), 2, 2, 1, True, 2.5)),
        "pool_keys": (pool_keys.write_pool_keys_op, (torch.randn(2, n, 2), torch.randn(2, n, 16), 1,
                                                     torch.randperm(n)[:nl].view(1, nl), torch.randperm(n)[:nl].view(1, nl),
                                                     torch.tensor([5]), 3, torch.randn(4, 8))),
        "moe": (moe.moe_experts_op, (torch.randn(3, hid), torch.randn(e, inter, hid), torch.randn(e, inter, hid),
                                     torch.randn(e, hid, inter), weights, ids, None)),
        "moe_fp8": (moe.moe_experts_fp8_op, (torch.randn(3, hid), gate, gate_s, gate, gate_s, down, down_s,
                                             weights, ids, 4, 10.0)),
        "moe_grouped": (moe_grouped.moe_experts_grouped_op, (torch.randn(3, hid), torch.randn(e, inter, hid),
                                                             torch.randn(e, inter, hid), torch.randn(e, hid, inter),
                                                             weights, ids.clamp(max=e - 1).index_fill(0, torch.tensor([1]), e), 10.0)),
        "moe_grouped_fp8": (moe_grouped.moe_experts_grouped_fp8_op, (torch.randn(3, hid), gate, gate_s, gate, gate_s,
                                                                     down, down_s, weights, ids, 4, None)),
        "dequant": (fp8_block.fp8_block_dequant_op, (w, s, 16, torch.float32)),
        "fp8_matmul": (fp8_block.fp8_block_matmul_op, (torch.randn(2, 3, 48), w, s, 16)),
        "heads_absorb": (fp8_block.fp8_heads_matmul_op, (torch.randn(2, 3, 4, 16), hw, hs, 4, 0, 16, True, 16)),
        "heads_value": (fp8_block.fp8_heads_matmul_op, (torch.randn(2, 3, 4, 32), hw, hs, 4, 16, 16, False, 16)),
        "write_rows": (write_rows, (torch.randn(2, n, 6), 1, torch.randperm(n)[:6], torch.randn(2, 3, 6))),
    }


@pytest.mark.parametrize("name", list(_op_cases()))
def test_custom_op_opcheck(name):
    op, args = _op_cases()[name]
    utils = torch.library._OPCHECK_DEFAULT_UTILS
    fp8 = [a for a in args if isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn]
    if fp8:  # test_schema's mutation check compares inputs with allclose, which FP8 tensors lack
        utils = tuple(u for u in utils if u != "test_schema")
        before = [a.view(torch.uint8).clone() for a in fp8]
    torch.library.opcheck(op, args, test_utils=utils)
    if fp8:
        assert all(torch.equal(a.view(torch.uint8), b) for a, b in zip(fp8, before)), "an FP8 input was written"
