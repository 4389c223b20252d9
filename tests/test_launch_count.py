"""diagnostics/launch_count.py: launches counted on the CPU, a dispatcher as one."""

import torch

from glm5mtp_cli.diagnostics.launch_count import Launches, count_launches
from kernels.rmsnorm import rmsnorm


def test_a_dispatcher_is_one_launch_and_views_none():
    mode = Launches()
    norm = mode.dispatcher("rmsnorm", rmsnorm)
    x, w = torch.randn(4, 8), torch.randn(8)
    with mode:
        mode.on = True
        y = norm(x, w, 1e-5).view(2, 16).t()  # the reference's six ops count as the one kernel
        (y + 1).sum()
    assert mode.ops == {"kernels.rmsnorm": 1, "add": 1, "sum": 1}


def test_glm5next_nano_step_phases():
    """One MLA attention and one pooled-indexer scoring per indexed forward: the gamma-3 chain's
    three draft forwards attend once each and score once (chained steps reuse step 0's choice);
    the verify runs three KDA layers and one indexed layer."""
    phases = count_launches("glm5next-nano", gamma=3, new_tokens=12)
    chain, verify = phases["draft chain"], phases["verify"]
    assert chain["kernels.mla_attention_paged"] == 3 and chain["kernels.indexer_scores_paged"] == 1
    assert verify["kernels.kda_slots"] == 3 and verify["kernels.mla_attention_paged"] == 1
    # each MLP's activation is one launch; only the catch-up can hold a row 0 (its embedding zeroed)
    # or needs its rows' visible pools: the chained steps' shared selection is built once a chain
    # (one ge) and read uncut
    assert chain["kernels.swiglu"] == 3 and verify["kernels.swiglu"] == 4
    assert chain["eq"] == 1 and chain["floor_divide"] == 1 and chain["ge"] == 1 and "where" not in chain
    assert sum(chain.values()) > sum(verify.values()) > 50
