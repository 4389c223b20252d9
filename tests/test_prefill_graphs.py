"""--prefill-graphs: the admission prefill's forwards as static forwards (captured on CUDA) give the
eager prefill's tokens, build a bucket at its first use, and give every block back."""

from __future__ import annotations

import pytest
import torch

from glm5mtp_cli.engine.config import EngineConfig
from glm5mtp_cli.checkpoint.load import load_models
from glm5mtp_cli.checkpoint.resolve import resolve_model
from glm5mtp_cli.engine.prefill_graphs import bucket
from glm5mtp_cli.engine.runtime import Runtime, make_engine
from glm5mtp_cli.engine.sequence import Request
from glm5mtp_cli.errors import UserError

# different lengths (one over index_topk), so forwards pad rows and sequences into their buckets
REQUESTS = [([3, 17, 99, 4, 250], 12), (list(range(10, 40)), 9), ([7] * 3 + list(range(60, 81)), 14),
            (list(range(100, 119)), 10)]


@pytest.fixture(scope="module")
def rt(spec_runtime):
    return spec_runtime


def _engine(rt, pools, gamma, mode, prefill_graphs=False, device="cpu"):
    # chunks of 16 rows: the longer prompts prefill in several forwards, the later ones at nonzero starts
    return make_engine(rt, pools, EngineConfig(gamma=gamma, max_seq_len=128, eos_ids=(), graphs=mode, prefill_graphs=prefill_graphs, prefill_chunk=16))


def _calls(engine, batch):
    """Two calls over the same requests: the second replays the buckets the first one built."""
    reqs = [Request(p, n, i) for i, (p, n) in enumerate(REQUESTS)]
    return [[r.tokens for r in engine.generate(reqs, batch_size=batch)] for _ in range(2)]


def test_a_full_batch_fits_beside_both_scratch_blocks(rt):
    """run_generate sizes the pools for its batch: with --prefill-graphs they also hold the prefill
    forwards' scratch block (the H200's first batch-1 run with it found the pool one block short)."""
    from glm5mtp_cli.engine.run import run_generate
    from glm5mtp_cli.engine.sampling import SamplingParams

    prompts = [p for p, _ in REQUESTS]
    runs = [run_generate(rt, prompts, EngineConfig(gamma=3, max_new_tokens=8, sampling=SamplingParams(), batch_size=1, max_seq_len=128, alloc="budget", draft_conf_tau=None, eos_ids=(), graphs="static", prefill_graphs=pg))[0] for pg in (False, True)]
    assert [r.tokens for r in runs[1]] == [r.tokens for r in runs[0]]


def test_bucket_rounds_up_to_a_power_of_two():
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert bucket(3, 16) == 16 and bucket(17, 16) == 32


@pytest.mark.parametrize("gamma", [0, 3])
@pytest.mark.parametrize("batch", [1, 2])
def test_static_prefill_equals_eager(rt, gamma, batch):
    pools = rt.make_pools(128, batch + 1, block_size=4)
    eager = _engine(rt, pools, gamma, "eager")
    static = _engine(rt, pools, gamma, "static", prefill_graphs=True)
    try:
        assert _calls(static, batch) == _calls(eager, batch)
        prefill = static.runner.prefill
        assert prefill.replays > 0, "no prefill forward ran from a bucket"
        owners = {key[0] for key in prefill.forwards}
        assert owners == ({"target", "drafter"} if gamma else {"target"})
    finally:
        static.close()
        eager.close()
    assert not any(pools.blocks_held().values()), "a block stayed held after close"


def test_a_bucket_is_built_at_its_first_use_and_not_past_the_row_cap(rt):
    pools = rt.make_pools(128, 2, block_size=4)
    engine = _engine(rt, pools, 0, "static", prefill_graphs=True)
    try:
        engine.generate([Request(list(range(10, 42)), 4)])  # two forwards of 16 rows: both from the bucket
        assert list(engine.runner.prefill.forwards) == [("target", 1, 16)] and engine.runner.prefill.replays == 2
        engine.runner.prefill.max_rows = 8  # a forward over the cap stays eager
        engine.generate([Request(list(range(50, 82)), 4)])
        assert engine.runner.prefill.replays == 2
    finally:
        engine.close()
    assert not any(pools.blocks_held().values())


def test_the_row_cap_shrinks_with_the_model_width():
    """glm5-nano (hidden 384) replays buckets up to 16384 rows; GLM-5's real width (6144) keeps the
    2048 rows of the earlier cap (a wide model's prefill is GPU-bound sooner, and its activations
    grow with rows x width)."""
    from glm5mtp_cli.checkpoint.resolve import resolve_config
    from glm5mtp_cli.engine.prefill_graphs import graph_rows

    assert graph_rows(resolve_config("glm5-nano")[0].hidden_size) == 16384
    assert graph_rows(resolve_config("glm5")[0].hidden_size) == 2048
    assert graph_rows(1024) == 12288


def test_prefill_graphs_need_static_forwards(rt):
    pools = rt.make_pools(128, 2, block_size=4)
    with pytest.raises(UserError, match="--prefill-graphs"):
        _engine(rt, pools, 0, "eager", prefill_graphs=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_prefill_equals_eager_on_cuda(spec_ckpt):
    """On a GPU (fp32): prefill replayed from CUDA graphs gives the eager prefill's tokens, decode
    graphs on in both."""
    folder, _ = spec_ckpt
    resolved = resolve_model(str(folder), progress=False)
    target, mtp, _ = load_models(resolved, "cuda", torch.float32)
    grt = Runtime(resolved, resolved.config, target.eval(), mtp.eval(), None, torch.device("cuda"), torch.float32)
    for gamma in (0, 3):
        pools = grt.make_pools(128, 3, block_size=4)
        plain = _engine(grt, pools, gamma, "cuda", device="cuda")
        captured = _engine(grt, pools, gamma, "cuda", prefill_graphs=True, device="cuda")
        try:
            assert _calls(captured, 2) == _calls(plain, 2), gamma
            assert captured.runner.prefill.replays > 0
        finally:
            captured.close()
            plain.close()
        assert not any(pools.blocks_held().values())


@pytest.mark.parametrize("cmd", [["generate", "--prompt", "def f(x):"],
                                 ["bench", "--batch-sizes", "1", "--gammas", "0", "--max-new-tokens", "4"]])
def test_cli_refuses_prefill_graphs_without_cuda_graphs_in_one_line(cmd):
    from typer.testing import CliRunner

    from glm5mtp_cli.cli import app

    r = CliRunner().invoke(app, [*cmd, "--device", "cpu", "--prefill-graphs"])
    assert r.exit_code == 2, r.output
    assert "--prefill-graphs" in r.output and "needs --device cuda" in r.output
    assert len(r.output.strip().splitlines()) == 1, r.output
