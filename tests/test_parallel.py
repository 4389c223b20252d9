"""Tensor/expert parallel (gloo, 2 CPU processes): sharded output equals the single-device output.

One spawned pair of ranks (a module fixture) runs every in-process section: on spec_ckpt loading
(slices only), logits, the argmax exchange, greedy identity for gamma 0 and 3 with equal first-step
drafts, sampled drafts in lockstep, static forwards (the CUDA-graph path) against tp 1 eager, the
missing all-reduce failure mode; random weights at tp 1 and
2; the trained model's drafter without its all-reduces. Each section returns what it measured and a
test per section judges it. The CLI is checked end to end (the launcher: `generate --tp 2`, an
error raised on a rank).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback

import pytest
import torch
from typer.testing import CliRunner

sys.path.insert(0, os.path.dirname(__file__))
import rank_sections  # noqa: E402
from proposer_calls import sharded  # noqa: E402

from glm5mtp_cli.engine.config import ModelSpec, EngineConfig
from glm5mtp_cli.engine import launch
from glm5mtp_cli.core.parallel import Comm
from glm5mtp_cli.cli import app
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.models.glm5.attention import MLAttention
from glm5mtp_cli.models.glm5.layers import MLP, MoE

PROMPTS = [[3, 17, 99, 4, 250], list(range(10, 40))]
RANDOM_PROMPT = [3, 17, 99, 4, 250, 6, 7, 8, 9, 10]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


class _NoReduce(Comm):
    """A Comm whose all-reduce does nothing: each rank keeps its partial sum."""

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t


def strip_comm(module: torch.nn.Module) -> int:
    """Skip the all-reduces of a sharded GLM-5 module's layers: what running the sharded head
    without its reductions computes (partial sums). Returns how many reductions were dropped."""
    n = 0
    for m in module.modules():
        c = m.__dict__.get("comm")
        if isinstance(m, (MLAttention, MoE, MLP)) and c is not None and not isinstance(c, _NoReduce):
            m.comm = _NoReduce(c.rank, c.world, c.group, c.local_rank)
            n += 1
    return n


def _engine(rt, gamma, sampling=None):
    from glm5mtp_cli.engine.sampling import SamplingParams
    from glm5mtp_cli.engine.runtime import make_engine

    pools = rt.make_pools(128, 1, block_size=4)
    return make_engine(rt, pools, EngineConfig(gamma=gamma, sampling=sampling or SamplingParams(), max_seq_len=256, eos_ids=(), check_invariants=True, graphs="eager"))


def _generate(rt, gamma, sampling=None, prompts=PROMPTS, max_new_tokens=20):
    from glm5mtp_cli.engine.sequence import Request

    res = _engine(rt, gamma, sampling).generate([Request(p, max_new_tokens, i) for i, p in enumerate(prompts)])
    return [r.tokens for r in res], sum(r.acceptance.accepted for r in res), sum(r.acceptance.proposed for r in res)


def _first_drafts(rt, prompt, gamma=3, sampling=None) -> list[int]:
    """The drafts of the first verify step, as the engine's proposer returned them."""
    from glm5mtp_cli.engine import drafting
    from glm5mtp_cli.engine.sequence import Request

    engine = _engine(rt, gamma, sampling)
    seen = []
    original = drafting.propose

    def spy(*args, **kwargs):
        chains = original(*args, **kwargs)
        seen.append(chains[0].tokens.tolist())
        return chains

    drafting.propose = spy
    try:
        engine.generate([Request(prompt, 2)])
    finally:
        drafting.propose = original
    return seen[0]


def _param_bytes(*mods):
    return sum(t.numel() * t.element_size() for m in mods for t in m.state_dict().values())


# ---- rank side: each section returns what it measured (JSON), the tests below judge it ----------

def _spec_models(folder: str, comm):
    """spec_ckpt at tp 1 and at tp 2 (this rank's shard), fp32, with the bytes each load read."""
    from glm5mtp_cli.checkpoint.load import load_models
    from glm5mtp_cli.checkpoint.resolve import resolve_model
    from glm5mtp_cli.engine.runtime import Runtime

    resolved = resolve_model(folder, progress=False)
    s1, s2 = {}, {}
    t1, m1, _ = load_models(resolved, "cpu", torch.float32, stats=s1)
    t2, m2, _ = load_models(resolved, "cpu", torch.float32, comm=comm, stats=s2)
    cfg = resolved.config
    rt1 = Runtime(resolved, cfg, t1.eval(), m1.eval(), None, torch.device("cpu"), torch.float32)
    rt2 = Runtime(resolved, cfg, t2.eval(), m2.eval(), None, torch.device("cpu"), torch.float32, comm)
    return {"cfg": cfg, "rt1": rt1, "rt2": rt2, "s1": s1, "s2": s2}


def _section_loading(comm, c):
    from glm5mtp_cli.engine.mtp_head import MtpHead

    cfg, t1, m1, t2, m2 = c["cfg"], c["rt1"].target, c["rt1"].mtp, c["rt2"].target, c["rt2"].mtp
    attn = t2.model.layers[0].self_attn
    return {"heads": cfg.num_attention_heads, "experts": cfg.n_routed_experts, "vocab": cfg.vocab_size,
            "hidden": cfg.hidden_size, "qk_head_dim": cfg.qk_head_dim, "v_head_dim": cfg.v_head_dim,
            "q_lora_rank": cfg.q_lora_rank, "rank_heads": attn.n_heads,
            "q_b_proj": list(attn.q_b_proj.weight.shape), "o_proj": list(attn.o_proj.weight.shape),
            "rank_experts": t2.model.layers[1].mlp.experts.gate.shape[0], "lm_head": list(t2.lm_head.weight.shape),
            "bytes_read": [c["s1"]["bytes_read"], c["s2"]["bytes_read"]],
            "bytes_held": [_param_bytes(t1, m1), _param_bytes(t2, m2)],
            "needs_comm": [sharded(MtpHead(m, t.model.embed_tokens, t.lm_head, None, EngineConfig(max_seq_len=8)))
                           for t, m in ((t1, m1), (t2, m2))]}


def _drafter_logits(cfg, t, m, ids):
    """The target's and the MTP layer's logits over ids (fresh caches)."""
    from glm5mtp_cli.engine.cache import CachePools

    pools = CachePools.create(cfg, 40, 4, torch.float32, "cpu", with_drafter=True)
    out = t(ids, [pools.target_cache(), pools.target_cache()])
    d = m(ids[:, 1:], out.hidden_all[:, :-1], [pools.drafter_cache(), pools.drafter_cache()],
          t.model.embed_tokens, t.lm_head)
    return out.logits, d.logits


def _section_logits(comm, c):
    ids = torch.randint(0, c["cfg"].vocab_size, (2, 21), generator=torch.Generator().manual_seed(0))
    c["ids"] = ids
    one = _drafter_logits(c["cfg"], c["rt1"].target, c["rt1"].mtp, ids)
    two = _drafter_logits(c["cfg"], c["rt2"].target, c["rt2"].mtp, ids)
    return {"target_rel": _rel(two[0], one[0]), "mtp_rel": _rel(two[1], one[1])}


def _section_argmax(comm, c):
    cfg, t1, t2 = c["cfg"], c["rt1"].target, c["rt2"].target
    with torch.no_grad():
        hid = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
        exchanged, gathered = t2.lm_head.argmax(hid).tolist(), t1.lm_head(hid).argmax(-1).tolist()
    half = cfg.vocab_size // 2
    tie = torch.zeros(3, half)
    tie[0] = 1.0                       # every entry ties: index 0
    tie[1, 5] = 2.0                    # same maximum at local 5 on both ranks: rank 0's wins
    tie[2, half - 1 - comm.rank] = 3.0  # rank 0 at half-1, rank 1 at half-2 (global 2*half-2): lowest is rank 0's
    return {"exchanged": exchanged, "gathered": gathered, "ties": comm.argmax(tie, comm.rank * half).tolist(),
            "half": half}


def _section_greedy(comm, c):
    out = {}
    for gamma in (0, 3):
        for tp, rt in ((1, c["rt1"]), (2, c["rt2"])):
            tokens, accepted, proposed = _generate(rt, gamma)
            out[f"tp{tp}_gamma{gamma}"] = {"tokens": tokens, "accepted": accepted, "proposed": proposed}
    out["first_drafts"] = [_first_drafts(c["rt1"], PROMPTS[1]), _first_drafts(c["rt2"], PROMPTS[1])]
    return out


def _section_sampling(comm, c):
    """Every rank draws the same drafts and tokens (same seed, gathered distribution)."""
    from glm5mtp_cli.engine.sampling import SamplingParams

    samp = SamplingParams(temperature=0.8, seed=7)
    tokens, _, _ = _generate(c["rt2"], 3, samp)
    flat = torch.tensor([t for seq in tokens for t in seq])
    drafts = torch.tensor(_first_drafts(c["rt2"], PROMPTS[1], sampling=samp))
    return {"tokens_per_rank": comm.all_gather(flat[None], dim=0).tolist(),
            "drafts_per_rank": comm.all_gather(drafts[None], dim=0).tolist()}


STATIC_REQUESTS = [([3, 17, 99, 4, 250], 14), (list(range(10, 40)), 9), ([7, 7, 7] + list(range(60, 72)), 16)]


def _modes_run(rt, gamma, mode, sampling=None, prefill_graphs=False, chunk=1024):
    """STATIC_REQUESTS through 2 slots (the third request re-occupies a slot) in a forward mode;
    -> tokens, (proposed, accepted) per request, whether the static forwards were built, and how
    many prefill forwards ran from --prefill-graphs' buckets."""
    from glm5mtp_cli.engine.sampling import SamplingParams
    from glm5mtp_cli.engine.runtime import make_engine
    from glm5mtp_cli.engine.sequence import Request

    pools = rt.make_pools(128, 2, block_size=4)
    engine = make_engine(rt, pools, EngineConfig(gamma=gamma, sampling=sampling or SamplingParams(), max_seq_len=128, eos_ids=(), check_invariants=True, graphs=mode, prefill_graphs=prefill_graphs, prefill_chunk=chunk))
    res = engine.generate([Request(p, n, i) for i, (p, n) in enumerate(STATIC_REQUESTS)], batch_size=2)
    built = engine.runner.graphs is not None
    replays = engine.runner.prefill.replays if engine.runner.prefill is not None else 0
    engine.close()
    return {"tokens": [r.tokens for r in res], "counts": [[r.acceptance.proposed, r.acceptance.accepted] for r in res],
            "built": built, "prefill_replays": replays}


def _section_static(comm, c):
    """The static forwards (what CUDA graphs replay, run eagerly: gloo cannot be captured) under tp 2,
    their collectives inside, against tp 1 eager: greedy at gamma 0 and 3; sampled, every rank's own."""
    from glm5mtp_cli.engine.sampling import SamplingParams

    out = {}
    for gamma in (0, 3):
        out[f"gamma{gamma}"] = {"tp1_eager": _modes_run(c["rt1"], gamma, "eager"),
                                "tp2_static": _modes_run(c["rt2"], gamma, "static")}
    samp = SamplingParams(temperature=0.8, seed=7)
    static = _modes_run(c["rt2"], 3, "static", samp)
    flat = torch.tensor([t for seq in static["tokens"] for t in seq])
    out["sampled"] = {"eager": _modes_run(c["rt2"], 3, "eager", samp)["tokens"], "static": static["tokens"],
                      "per_rank": comm.all_gather(flat[None], dim=0).tolist()}
    # --prefill-graphs: prompts in chunks of 8 rows, so buckets are met twice and run (collectives inside)
    out["prefill_graphs"] = {"tp1_eager": _modes_run(c["rt1"], 3, "eager", chunk=8),
                             "tp2": _modes_run(c["rt2"], 3, "static", prefill_graphs=True, chunk=8)}
    return out


def _section_stripped(comm, c):
    """The head's sharded layers without their all-reduces draft from partial sums (mutates rt2's MTP
    layer: the last section on spec_ckpt)."""
    cfg, rt2 = c["cfg"], c["rt2"]
    good = _drafter_logits(cfg, rt2.target, rt2.mtp, c["ids"])[1]
    stripped = strip_comm(rt2.mtp)
    bad = _generate(rt2, 3)
    return {"stripped": stripped, "mtp_rel": _rel(_drafter_logits(cfg, rt2.target, rt2.mtp, c["ids"])[1], good),
            "tokens": bad[0], "accepted": bad[1], "proposed": bad[2],
            "tp1_gamma0_tokens": _generate(c["rt1"], 0)[0]}


def _section_random_weights(comm, c):
    """--random-weights seeds each tensor by name, so the ranks hold slices of the very weights one
    device holds: the same tokens at tp 1 and tp 2."""
    from glm5mtp_cli.engine.runtime import load_runtime

    out = {}
    for tp, rank_comm in ((1, None), (2, comm)):
        rt = load_runtime(ModelSpec("glm5-tiny", "cpu", "auto", random_weights=True), progress=False, comm=rank_comm)
        out[f"tp{tp}"] = {"tokens": _generate(rt, 2, prompts=[RANDOM_PROMPT], max_new_tokens=8)[0],
                          "weights_bytes": rt.weight_bytes()}
    return out


def _section_trained(comm, c):
    """The shipped trained model at tp 2, with the drafter's all-reduces present, then removed (the
    head run as if it were unsharded)."""
    from glm5mtp_cli.engine.runtime import load_runtime
    from glm5mtp_cli.engine.sequence import Request

    rt = load_runtime(ModelSpec("glm5-nano", "cpu", "fp32"), progress=False, comm=comm)
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
    return {"stripped": stripped, "good_mal": good_mal, "bad_mal": bad_mal, "same_tokens": good_tokens == bad_tokens}


SECTIONS = ["loading", "logits", "argmax", "greedy", "sampling", "static", "stripped", "random_weights", "trained"]


def _rank_sections(folder: str, out_dir: str) -> None:
    """Runs on each of 2 ranks (launch.spawn). A section that raises records its traceback and the
    next one runs; each rank rewrites its report after every section, so a rank that dies leaves
    what it had."""
    comm = launch.rank_comm(2, "cpu")
    assert comm is not None and comm.world == 2
    report = {}
    path = os.path.join(out_dir, f"rank{comm.rank}.json")
    ctx = None
    for name in SECTIONS:
        try:
            if ctx is None and name in SECTIONS[:7]:
                ctx = _spec_models(folder, comm)
            report[name] = globals()[f"_section_{name}"](comm, ctx)
        except Exception:
            report[name] = {"error": traceback.format_exc()}
        with open(path, "w") as f:
            json.dump(report, f)


@pytest.fixture(scope="module")
def tp_group(spec_ckpt, tmp_path_factory):
    """Every section's report per rank, from one spawned pair of ranks."""
    folder, _ = spec_ckpt
    return rank_sections.spawn(_rank_sections, str(folder), tmp_path_factory.mktemp("tp_group"))


def _section(tp_group, name: str, rank: int = 0) -> dict:
    return rank_sections.section(tp_group, name, rank)


@pytest.mark.parametrize("rank", [0, 1])
def test_tp2_loads_only_its_slices(tp_group, rank):
    d = _section(tp_group, "loading", rank)
    assert d["rank_heads"] == d["heads"] // 2
    assert d["q_b_proj"] == [d["heads"] // 2 * d["qk_head_dim"], d["q_lora_rank"]]
    assert d["o_proj"] == [d["hidden"], d["heads"] // 2 * d["v_head_dim"]]
    assert d["rank_experts"] == d["experts"] // 2
    assert d["lm_head"] == [d["vocab"] // 2, d["hidden"]]
    # fp32 file, fp32 load: bytes read == bytes held, and a rank reads well under the whole
    assert d["bytes_read"] == d["bytes_held"], d
    assert d["bytes_read"][1] < 0.7 * d["bytes_read"][0], d
    assert d["needs_comm"] == [False, True]


def test_tp2_logits_equal_tp1(tp_group):
    d = _section(tp_group, "logits")
    assert d["target_rel"] < 1e-5 and d["mtp_rel"] < 1e-5, d  # fp32: equal to 1e-5 relative


def test_tp2_argmax_exchange(tp_group):
    """Greedy argmax by (max, index) exchange: equals the gathered argmax, ties to the lowest index."""
    d = _section(tp_group, "argmax")
    assert d["exchanged"] == d["gathered"]
    assert d["ties"] == [0, 5, d["half"] - 1], d


def test_tp2_greedy_equals_tp1(tp_group):
    d = _section(tp_group, "greedy")
    for gamma in (0, 3):
        assert d[f"tp2_gamma{gamma}"] == d[f"tp1_gamma{gamma}"], gamma
    assert d["tp1_gamma3"]["accepted"] > 0
    assert d["tp1_gamma3"]["tokens"] == d["tp1_gamma0"]["tokens"]
    one, two = d["first_drafts"]
    assert len(one) == 3 and one == two


def test_tp2_sampling_in_lockstep(tp_group):
    d = _section(tp_group, "sampling")
    assert d["tokens_per_rank"][0] == d["tokens_per_rank"][1]
    assert d["drafts_per_rank"][0] == d["drafts_per_rank"][1] and len(d["drafts_per_rank"][0]) == 3


def test_tp2_static_forwards_equal_tp1_eager(tp_group):
    """Static mode under --tp: the graph code path with its collectives inside gives tp 1's tokens
    and acceptance (fp32, greedy, 2 slots, one re-occupied); sampled, the ranks agree and equal eager."""
    d = _section(tp_group, "static")
    for gamma in (0, 3):
        one, two = d[f"gamma{gamma}"]["tp1_eager"], d[f"gamma{gamma}"]["tp2_static"]
        assert two["built"] and not one["built"]
        assert two["tokens"] == one["tokens"] and two["counts"] == one["counts"], gamma
    acc = sum(a for _, a in d["gamma3"]["tp1_eager"]["counts"])
    assert 0 < acc < sum(p for p, _ in d["gamma3"]["tp1_eager"]["counts"])  # accepted and rejected paths ran
    s = d["sampled"]
    assert s["static"] == s["eager"] and s["per_rank"][0] == s["per_rank"][1]
    one, two = d["prefill_graphs"]["tp1_eager"], d["prefill_graphs"]["tp2"]
    assert two["prefill_replays"] > 0 and two["tokens"] == one["tokens"] and two["counts"] == one["counts"]


def test_tp2_drafter_without_all_reduce_stays_lossless(tp_group):
    """The failure mode: the head's sharded layers without their all-reduces draft from partial sums.
    Output stays the target's (lossless), but the drafts change and acceptance does not rise."""
    d = _section(tp_group, "stripped")
    greedy = _section(tp_group, "greedy")
    assert d["stripped"] == 2  # after o_proj and after the MoE
    assert d["tokens"] == d["tp1_gamma0_tokens"]  # still lossless
    assert d["mtp_rel"] > 1e-2, d
    assert d["accepted"] <= greedy["tp2_gamma3"]["accepted"], d


def test_random_weights_tp2_equals_tp1(tp_group):
    d = _section(tp_group, "random_weights")
    assert d["tp2"]["tokens"] == d["tp1"]["tokens"] and len(d["tp1"]["tokens"][0]) == 8
    assert d["tp2"]["weights_bytes"]["target"] < 0.7 * d["tp1"]["weights_bytes"]["target"]


def test_missing_drafter_all_reduce_only_lowers_acceptance(tp_group):
    """The silent failure of a sharded drafter run without its reductions, on the trained model:
    the output is still the target's, but the mean acceptance length drops."""
    d = _section(tp_group, "trained")
    assert d["stripped"] == 2 and d["same_tokens"]
    assert d["good_mal"] > 2.5, d  # the trained drafter, correctly reduced
    assert d["bad_mal"] < 0.85 * d["good_mal"], d  # measured: 3.05 -> 2.24


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


def test_cli_generate_draft_vocab_tp2_equals_tp1():
    """--draft-vocab under --tp: each rank scores the draft ids it holds, gathered back in tp 1's
    order, so the drafts, the acceptance and the tokens are tp 1's (glm5-nano: trained, so drafts
    are accepted; its 3000 most frequent tokens lie on both halves of the vocabulary, 1591 and 1409)."""
    args = ["generate", "--model", "glm5-nano", "--prompt", "def binary_search(items, target):", "--gamma", "3",
            "--max-new-tokens", "16", "--ignore-eos", "--draft-vocab", "3000", "--json", "--device", "cpu",
            "--dtype", "fp32"]
    one, two = _generate_tp1_and_tp2(args)
    assert two["requests"][0]["tokens"] == one["requests"][0]["tokens"]
    assert two["acceptance"] == one["acceptance"] and one["acceptance"]["accepted"] > 0


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cli_generate_tp2_cuda_graphs_equal_tp1_graphs(tmp_path):
    """On 2 GPUs: --tp 2 captures its NCCL collectives inside the decode, verify and draft-chain
    graphs; fp32 greedy tokens equal one GPU's graphs (2 slots, the third prompt re-occupies one)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in
                               ("def binary_search(items, target):\n", "import os\n\n\ndef read_lines(path):\n",
                                "class Point:\n")))
    for gamma in ("0", "3"):
        args = ["generate", "--model", "glm5-nano", "--prompts", str(prompts), "--batch-size", "2", "--gamma", gamma,
                "--max-new-tokens", "48", "--ignore-eos", "--json", "--device", "cuda", "--dtype", "fp32"]
        d1, d2 = _generate_tp1_and_tp2(args)
        assert d1["graphs"] == d2["graphs"] == "cuda" and d2["tp"] == 2
        assert [r["tokens"] for r in d2["requests"]] == [r["tokens"] for r in d1["requests"]], gamma
        assert d2["acceptance"] == d1["acceptance"], gamma


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
