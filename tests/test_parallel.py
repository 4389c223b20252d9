"""Tensor/expert parallel (gloo, 2 CPU processes): sharded output equals the single-device output.

One spawned pair of ranks runs every in-process check (logits, argmax exchange, greedy identity for
gamma 0 and 3, first-step drafts, sampled drafts in lockstep, slices-only loading, the missing
all-reduce failure mode); the CLI is checked end to end once with `generate --tp 2`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from glm5mtp_cli.engine import launch
from glm5mtp_cli.cli import app
from glm5mtp_cli.errors import UserError

PROMPTS = [[3, 17, 99, 4, 250], list(range(10, 40))]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _engine(rt, gamma, sampling=None):
    from glm5mtp_cli.engine.runtime import make_engine
    from glm5mtp_cli.engine.sampling import SamplingParams

    pools = rt.make_pools(128, 1, block_size=4)
    return make_engine(rt, pools, gamma=gamma, sampling=sampling or SamplingParams(),
                      max_seq_len=256, eos_ids=[], check_invariants=True)


def _generate(rt, gamma, sampling=None):
    from glm5mtp_cli.engine.speculate import Request

    res = _engine(rt, gamma, sampling).generate([Request(p, 20, i) for i, p in enumerate(PROMPTS)])
    return [r.tokens for r in res], sum(r.acceptance.accepted for r in res), sum(r.acceptance.proposed for r in res)


def _first_drafts(rt, prompt, gamma=3):
    from glm5mtp_cli.engine.speculate import Request

    engine = _engine(rt, gamma)
    seq = engine.start(Request(prompt, 20))
    chain = engine.draft([seq])[0]
    engine.release(seq)
    return chain.tokens.tolist()


def _param_bytes(*mods):
    return sum(t.numel() * t.element_size() for m in mods for t in m.state_dict().values())


def _rank_checks(folder: str, report_path: str) -> None:
    """Runs on each of 2 ranks (launch.spawn): sharded (tp 2) against unsharded (tp 1) in one process."""
    import torch.distributed as dist

    from glm5mtp_cli.engine.cache import CachePools
    from glm5mtp_cli.checkpoint.load import load_models
    from glm5mtp_cli.checkpoint.resolve import resolve_model
    from glm5mtp_cli.engine.mtp_head import MtpHead
    from glm5mtp_cli.models.glm5.sharding import strip_comm
    from glm5mtp_cli.engine.runtime import Runtime, make_engine
    from glm5mtp_cli.engine.sampling import SamplingParams

    comm = launch.rank_comm(2, "cpu")
    assert comm is not None and comm.world == 2
    resolved = resolve_model(folder, progress=False)
    s1, s2 = {}, {}
    t1, m1, _ = load_models(resolved, "cpu", torch.float32, stats=s1)
    t2, m2, _ = load_models(resolved, "cpu", torch.float32, comm=comm, stats=s2)
    cfg = resolved.config
    rt1 = Runtime(resolved, cfg, t1.eval(), m1.eval(), None, torch.device("cpu"), torch.float32)
    rt2 = Runtime(resolved, cfg, t2.eval(), m2.eval(), None, torch.device("cpu"), torch.float32, comm)
    report = {}

    # Loading: this rank's slices only (fp32 file, fp32 load: bytes read == bytes held).
    attn = t2.model.layers[0].self_attn
    assert attn.n_heads == cfg.num_attention_heads // 2
    assert tuple(attn.q_b_proj.weight.shape) == (cfg.num_attention_heads // 2 * cfg.qk_head_dim, cfg.q_lora_rank)
    assert tuple(attn.o_proj.weight.shape) == (cfg.hidden_size, cfg.num_attention_heads // 2 * cfg.v_head_dim)
    assert t2.model.layers[1].mlp.experts.gate.shape[0] == cfg.n_routed_experts // 2
    assert tuple(t2.lm_head.weight.shape) == (cfg.vocab_size // 2, cfg.hidden_size)
    assert s2["bytes_read"] == _param_bytes(t2, m2), (s2, _param_bytes(t2, m2))
    assert s1["bytes_read"] == _param_bytes(t1, m1)
    report["bytes_read"] = [s1["bytes_read"], s2["bytes_read"]]
    assert s2["bytes_read"] < 0.7 * s1["bytes_read"]
    assert m2 is not None and MtpHead(m2, t2.model.embed_tokens, t2.lm_head, None, 8).needs_comm()
    assert not MtpHead(m1, t1.model.embed_tokens, t1.lm_head, None, 8).needs_comm()

    # Logits of the target and the MTP layer, fp32: equal to 1e-5 relative.
    ids = torch.randint(0, cfg.vocab_size, (2, 21), generator=torch.Generator().manual_seed(0))
    logits = []
    for t, m in ((t1, m1), (t2, m2)):
        pools = CachePools.create(cfg, 40, 4, torch.float32, "cpu", with_drafter=True)
        out = t(ids, [pools.target_cache(), pools.target_cache()])
        d = m(ids[:, 1:], out.hidden_all[:, :-1], [pools.drafter_cache(), pools.drafter_cache()],
              t.model.embed_tokens, t.lm_head)
        logits.append((out.logits, d.logits))
    report["target_rel"] = _rel(logits[1][0], logits[0][0])
    report["mtp_rel"] = _rel(logits[1][1], logits[0][1])
    assert report["target_rel"] < 1e-5 and report["mtp_rel"] < 1e-5, report

    # Greedy argmax by (max, index) exchange: equals the gathered argmax, ties to the lowest index.
    h = logits[0][0].new_zeros(0)
    with torch.no_grad():
        hid = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
        assert torch.equal(t2.lm_head.argmax(hid), t1.lm_head(hid).argmax(-1))
    half = cfg.vocab_size // 2
    tie = torch.zeros(3, half)
    tie[0] = 1.0                       # every entry ties: index 0
    tie[1, 5] = 2.0                    # same maximum at local 5 on both ranks: rank 0's wins
    tie[2, half - 1 - comm.rank] = 3.0  # rank 0 at half-1, rank 1 at half-2 (global 2*half-2): lowest is rank 0's
    got = comm.argmax(tie, comm.rank * half).tolist()
    assert got == [0, 5, half - 1], got
    del h

    # Greedy identity for gamma 0 and 3; first-step drafts equal.
    for gamma in (0, 3):
        a, b = _generate(rt1, gamma), _generate(rt2, gamma)
        assert a == b, (gamma, a, b)
        report[f"gamma{gamma}"] = {"tokens": a[0], "accepted": a[1], "proposed": a[2]}
    assert _first_drafts(rt1, PROMPTS[1]) == _first_drafts(rt2, PROMPTS[1])

    # Sampling: every rank draws the same drafts and tokens (same seed, gathered distribution).
    samp = SamplingParams(temperature=0.8, seed=7)
    tokens, _, _ = _generate(rt2, 3, samp)
    flat = torch.tensor([t for seq in tokens for t in seq])
    both = comm.all_gather(flat[None], dim=0)
    assert torch.equal(both[0], both[1])
    chains = []
    engine = _engine(rt2, 3, samp)
    from glm5mtp_cli.engine.speculate import Request

    seq = engine.start(Request(PROMPTS[1], 20))
    chain = engine.draft([seq])[0]
    engine.release(seq)
    both = comm.all_gather(chain.tokens[None], dim=0)
    assert torch.equal(both[0], both[1])
    del chains

    # The failure mode: the head's sharded layers without their all-reduces draft from partial sums.
    # Output stays the target's (lossless), but the drafts change and acceptance drops.
    def drafter_logits():
        pools = CachePools.create(cfg, 40, 4, torch.float32, "cpu", with_drafter=True)
        out = t2(ids, [pools.target_cache(), pools.target_cache()])
        return m2(ids[:, 1:], out.hidden_all[:, :-1], [pools.drafter_cache(), pools.drafter_cache()],
                  t2.model.embed_tokens, t2.lm_head).logits

    good = drafter_logits()
    assert strip_comm(m2) == 2  # after o_proj and after the MoE
    report["stripped_mtp_rel"] = _rel(drafter_logits(), good)
    bad = _generate(rt2, 3)
    report["stripped"] = {"accepted": bad[1], "proposed": bad[2]}
    assert bad[0] == _generate(rt1, 0)[0]  # still lossless
    assert report["stripped_mtp_rel"] > 1e-2, report
    assert bad[1] <= report["gamma3"]["accepted"], report
    if comm.rank == 0:
        with open(report_path, "w") as f:
            json.dump(report, f)
    dist.barrier()


def test_tp2_equals_tp1_in_process(spec_ckpt, tmp_path):
    folder, _ = spec_ckpt
    out = tmp_path / "report.json"
    launch.spawn(2, "gloo", _rank_checks, {"folder": str(folder), "report_path": str(out)})
    report = json.loads(out.read_text())
    print(report)
    assert report["gamma3"]["accepted"] > 0


def _generate_tp1_and_tp2(args: list[str]) -> tuple[dict, dict]:
    """`generate --json` in process at tp 1, and as its own command (which spawns 2 ranks) at tp 2."""
    one = CliRunner().invoke(app, args)
    assert one.exit_code == 0, one.output
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    two = subprocess.run([sys.executable, "-m", "glm5mtp_cli.cli", *args, "--tp", "2"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert two.returncode == 0, two.stderr
    return json.loads(one.stdout), json.loads(two.stdout)


def test_cli_generate_tp2_equals_tp1(spec_ckpt):
    folder, _ = spec_ckpt
    args = ["generate", "--model", str(folder), "--prompt-ids", "3,17,99,4,250,6,7,8", "--gamma", "3",
            "--max-new-tokens", "12", "--ignore-eos", "--json", "--device", "cpu"]
    d1, d2 = _generate_tp1_and_tp2(args)
    assert d2["tp"] == 2 and d1["tp"] == 1
    assert d2["requests"][0]["tokens"] == d1["requests"][0]["tokens"]
    assert d2["acceptance"]["accepted"] == d1["acceptance"]["accepted"]
    assert d2["memory"]["weights_bytes"]["lm_head"] * 2 == d1["memory"]["weights_bytes"]["lm_head"]


@pytest.mark.parametrize("tp, needle", [(3, "does not divide the model's num_attention_heads (4)"),
                                        (0, "--tp must be >= 1")])
def test_bad_tp_is_one_line(spec_ckpt, tp, needle):
    folder, _ = spec_ckpt
    for cmd in (["generate", "--prompt-ids", "1,2"], ["leak-check"]):
        r = CliRunner().invoke(app, [*cmd, "--model", str(folder), "--device", "cpu", "--tp", str(tp)])
        assert r.exit_code == 2, r.output
        assert needle in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_error_on_a_rank_is_one_line_and_nonzero(spec_ckpt):
    """A UserError raised inside the ranks (a token outside the vocabulary) comes back as one line."""
    folder, _ = spec_ckpt
    r = subprocess.run([sys.executable, "-m", "glm5mtp_cli.cli", "generate", "--model", str(folder), "--prompt-ids",
                        "1,99999", "--device", "cpu", "--tp", "2"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert r.returncode == 2
    lines = [line for line in r.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "outside the vocabulary" in lines[0], r.stderr


def test_profile_predict_only_tp():
    r = CliRunner().invoke(app, ["profile", "--model", "glm5", "--predict-only", "--tp", "8", "--json",
                                 "--max-seq-len", "131072"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    rows = {(x["tp"], x["format"]): x for x in doc["tp_per_gpu"]["rows"]}
    assert {(n, f) for n in (1, 2, 4, 8) for f in ("bf16", "fp8")} <= set(rows)
    for f in ("bf16", "fp8"):
        w = [rows[(n, f)]["weights_per_gpu_bytes"] for n in (1, 2, 4, 8)]
        assert w[0] > w[1] > w[2] > w[3]
        # the per-sequence cache is replicated per rank (MLA latent shared by all heads)
        assert len({rows[(n, f)]["per_sequence_bytes"]["budget"] for n in (1, 2, 4, 8)}) == 1
    assert rows[(8, "fp8")]["weights_per_gpu_bytes"] < 100 * 2**30 < rows[(8, "bf16")]["weights_per_gpu_bytes"]
    assert any("replicated" in n for n in doc["tp_per_gpu"]["notes"])


def test_torchrun_env_mismatch_refused(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(UserError, match="WORLD_SIZE=4"):
        launch.rank_comm(2, "cpu")


def _trained_drafter_without_reductions(report_path: str) -> None:
    """Runs on each of 2 ranks: the shipped trained model at tp 2, with the drafter's all-reduces
    present, then removed (the head run as if it were unsharded)."""
    import torch.distributed as dist

    from glm5mtp_cli.models.glm5.sharding import strip_comm
    from glm5mtp_cli.engine.runtime import load_runtime
    from glm5mtp_cli.engine.speculate import Request

    comm = launch.rank_comm(2, "cpu")
    rt = load_runtime("glm5-nano", "cpu", "fp32", progress=False, comm=comm)
    prompts = [rt.tokenizer.encode(p) for p in ("def binary_search(items, target):\n",
                                                 "import os\n\n\ndef read_lines(path):\n")]

    def run():
        res = _engine(rt, 3).generate([Request(p, 32, i) for i, p in enumerate(prompts)])
        acc = sum(r.acceptance.accepted for r in res)
        steps = sum(r.acceptance.steps for r in res)
        return [r.tokens for r in res], 1 + acc / steps

    good_tokens, good_mal = run()
    stripped = strip_comm(rt.mtp)
    bad_tokens, bad_mal = run()
    if comm.rank == 0:
        with open(report_path, "w") as f:
            json.dump({"stripped": stripped, "good_mal": good_mal, "bad_mal": bad_mal,
                       "same_tokens": good_tokens == bad_tokens}, f)
    dist.barrier()


def test_missing_drafter_all_reduce_only_lowers_acceptance(tmp_path):
    """The silent failure of a sharded drafter run without its reductions, on the trained model:
    the output is still the target's, but the mean acceptance length drops."""
    out = tmp_path / "report.json"
    launch.spawn(2, "gloo", _trained_drafter_without_reductions, {"report_path": str(out)})
    report = json.loads(out.read_text())
    print(report)
    assert report["stripped"] == 2 and report["same_tokens"]
    assert report["good_mal"] > 2.5, report  # the trained drafter, correctly reduced
    assert report["bad_mal"] < 0.85 * report["good_mal"], report  # measured: 3.05 -> 2.24


def test_random_weights_tp2_equals_tp1():
    """--random-weights (real dimensions without a checkpoint) seeds each tensor by name, so the
    ranks hold slices of the very weights one device holds: the same tokens at tp 1 and tp 2."""
    args = ["generate", "--model", "glm5-tiny", "--random-weights", "--prompt-ids", "3,17,99,4,250,6,7,8,9,10",
            "--gamma", "2", "--max-new-tokens", "8", "--json", "--device", "cpu"]
    d1, d2 = _generate_tp1_and_tp2(args)
    assert d2["requests"][0]["tokens"] == d1["requests"][0]["tokens"]
    assert d2["memory"]["weights_bytes"]["target"] < 0.7 * d1["memory"]["weights_bytes"]["target"]
