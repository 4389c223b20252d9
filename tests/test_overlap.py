"""models/overlap.side_by_side: two branches on two streams give what they give one after the other,
eagerly and replayed from a CUDA graph; the MoE layer (shared expert beside the routing) is
unchanged by it bit for bit."""

import pytest
import torch

from glm5mtp_cli.models.overlap import side_by_side

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_branches_run_in_turn_on_the_cpu():
    order = []
    a, b = side_by_side(lambda: order.append("main") or torch.ones(1), lambda: order.append("side") or torch.zeros(1),
                        torch.empty(1))
    assert order == ["main", "side"] and a.item() == 1 and b.item() == 0


def _branches(x, w1, w2):
    # enough work on each branch that a missing join would read unfinished results
    return side_by_side(lambda: (x @ w1).relu() @ w1, lambda: (x @ w2).sigmoid() @ w2, x)


@cuda
@torch.no_grad()
def test_two_streams_equal_one_eager_and_in_a_graph():
    torch.manual_seed(0)
    x = torch.randn(64, 2048, device="cuda")
    w1, w2 = (torch.randn(2048, 2048, device="cuda") / 45 for _ in range(2))
    with torch.enable_grad():  # autograd on: the branches run in turn, on the current stream
        want = _branches(x, w1, w2)
    got = _branches(x, w1, w2)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    static = x.clone()
    _branches(static, w1, w2)  # warm-up (cuBLAS workspaces) before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _branches(static, w1, w2)
    for _ in range(3):
        x2 = torch.randn_like(x)
        static.copy_(x2)
        graph.replay()
        ref = (x2 @ w1).relu() @ w1, (x2 @ w2).sigmoid() @ w2
        assert all(torch.equal(g, w) for g, w in zip(out, ref))


@cuda
def test_moe_layer_unchanged_by_the_side_stream():
    from glm5mtp_cli.checkpoint.resolve import resolve_config
    from glm5mtp_cli.models.glm5.layers import MoE

    torch.manual_seed(0)
    moe = MoE(resolve_config("glm5-tiny")[0]).cuda()
    for p in moe.parameters():
        p.data.normal_(0, 0.05)
    x = torch.randn(3, moe.gate.weight.shape[1], device="cuda")
    with torch.no_grad():
        got = moe(x)  # shared expert on the side stream
    want = moe(x).detach()  # autograd on: one stream
    assert torch.equal(got, want)
