"""`glm5mtp bench` end to end on a tiny checkpoint (numbers are not judged here: machines are noisy)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from typer.testing import CliRunner

from glm5mtp_cli.checkpoint.resolve import resolve_config

from glm5mtp_cli.engine.config import ModelSpec, EngineConfig
from glm5mtp_cli.diagnostics.bench import add_ratios
from glm5mtp_cli.diagnostics.sizing import draft_step_bytes
from glm5mtp_cli.cli import app
from glm5mtp_cli.checkpoint.resolve import profile_path
from glm5mtp_cli.models.glm5.config import ModelConfig


def test_bench_json_rows_and_ratios(spec_ckpt, capfd):
    folder, _ = spec_ckpt
    r = CliRunner().invoke(app, ["bench", "--model", str(folder), "--gammas", "0,2", "--batch-sizes", "1,2",
                                 "--max-new-tokens", "6", "--repeats", "1", "--draft-context", "64",
                                 "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    # transformers' load report (every MTP key it does not use) and its bars stay off the terminal, whichever
    # stream its logging handler holds (the process's stderr: capfd sees it, not the runner)
    err = r.stderr + capfd.readouterr().err
    assert "LOAD REPORT" not in err and "Loading weights" not in err, err
    doc = json.loads(r.stdout)
    systems = [(row["batch"], row["system"]) for row in doc["rows"]]
    assert systems == [(1, "transformers"), (1, "gamma 0"), (1, "gamma 2"),
                       (2, "transformers"), (2, "gamma 0"), (2, "gamma 2")]
    rate = {(row["batch"], row["gamma"]): row["e2e_tokens_per_s"] for row in doc["rows"]}
    for row in doc["rows"]:
        assert row["e2e_tokens_per_s"] > 0
        # each ratio is to the same batch size's baseline row (the rates differ per row on any machine)
        b = row["batch"]
        assert row["speedup_vs_gamma0"] == pytest.approx(row["e2e_tokens_per_s"] / rate[(b, 0)], rel=1e-9)
        assert row["speedup_vs_transformers"] == pytest.approx(row["e2e_tokens_per_s"] / rate[(b, None)], rel=1e-9)
        if row["system"] != "transformers":  # end to end = admissions (prefill) + decode steps (one repeat)
            tokens = row["prompts"] * 6
            assert row["wall_prefill_s"] > 0 and row["wall_decode_s"] > 0
            assert tokens / (row["wall_prefill_s"] + row["wall_decode_s"]) == pytest.approx(row["e2e_tokens_per_s"])
            assert (tokens - row["prompts"]) / row["wall_decode_s"] == pytest.approx(row["decode_tokens_per_s"])
    assert doc["draft_step"]["step_ms"] > 0 and doc["draft_step"]["floor_ms"] is None  # no floor on the CPU
    # the gamma recommendation: gammas 0..2 predicted per batch size; the recommended one is the table's
    # fastest decode, the model's own pick beside it
    assert [rec["batch"] for rec in doc["recommendation"]] == [1, 2]
    for rec in doc["recommendation"]:
        assert len(rec["by_gamma"]) == 3 and rec["model_best_tokens_per_s"] == max(rec["by_gamma"])
        assert rec["by_gamma"][rec["best_gamma"]] == rec["predicted_tokens_per_s"]
        decode = {row["gamma"]: row["decode_tokens_per_s"] for row in doc["rows"]
                  if row["batch"] == rec["batch"] and row["gamma"] is not None}
        assert rec["best_gamma"] == max(decode, key=decode.get)
        assert rec["measured_tokens_per_s"] == decode[rec["best_gamma"]]
    # two gammas: the cost line runs through both runs, so a row's "prediction" would echo its measurement
    assert all(row["predicted_decode_tokens_per_s"] is None for row in doc["rows"])


def test_bench_table_prints_the_recommendation(spec_ckpt):
    folder, _ = spec_ckpt
    r = CliRunner().invoke(app, ["bench", "--model", str(folder), "--gammas", "0,2", "--batch-sizes", "1",
                                 "--max-new-tokens", "6", "--repeats", "1", "--no-transformers", "--draft-context",
                                 "16", "--device", "cpu"], terminal_width=200)
    assert r.exit_code == 0, r.output
    assert "pred." in r.output and "decode tokens/s (prefill excluded)" in r.output
    assert "capture" in r.output  # eager on the CPU: nothing captured, shown as "-"
    assert re.search(r"recommended gamma [02] at batch 1: measured [0-9.]+ decode tokens/s, the fastest run",
                     " ".join(r.output.split())), r.output


def test_bench_table_shows_capture_seconds_apart_from_e2e():
    from glm5mtp_cli.commands.bench import _capture

    assert _capture({"graph_capture_ms": 1234.0}) == "1.23"
    assert _capture({"graph_capture_ms": 0.0}) == "-" and _capture({}) == "-"


def test_ratios_are_to_the_same_batch_baseline():
    rows = [{"batch": 1, "gamma": None, "e2e_tokens_per_s": 10.0}, {"batch": 1, "gamma": 0, "e2e_tokens_per_s": 20.0},
            {"batch": 1, "gamma": 2, "e2e_tokens_per_s": 30.0}, {"batch": 4, "gamma": 0, "e2e_tokens_per_s": 50.0},
            {"batch": 4, "gamma": 2, "e2e_tokens_per_s": 125.0}]
    add_ratios(rows)
    assert [r["speedup_vs_gamma0"] for r in rows] == [0.5, 1.0, 1.5, 1.0, 2.5]
    # batch 4 has no transformers row: no ratio, not one to batch 1's baseline
    assert [r["speedup_vs_transformers"] for r in rows] == [1.0, 2.0, 3.0, None, None]


def test_draft_step_bytes_of_glm5_match_the_issue():
    """The issue measured 3.09 GB of active bf16 weights per GLM-5 draft step at batch 1."""
    cfg = ModelConfig.from_json_file(profile_path("glm5") / "config.json")
    b = draft_step_bytes(cfg, 2, context=1)
    assert abs((b["mtp_weights"] + b["lm_head"]) / 1e9 - 3.09) < 0.05
    assert b["lm_head"] == 154880 * 6144 * 2


def test_bad_bench_flags(spec_ckpt):
    folder, _ = spec_ckpt
    for args in (["--gammas", "0,x"], ["--batch-sizes", "0"], ["--repeats", "0"]):
        r = CliRunner().invoke(app, ["bench", "--model", str(folder), "--device", "cpu", *args])
        assert r.exit_code != 0 and "Traceback" not in r.output
    r = CliRunner().invoke(app, ["bench", "--model", str(folder), "--device", "cpu", "--gammas", "0,17"])
    assert r.exit_code == 2 and "--gammas: values must be <= 16" in r.stderr, r.output  # the list's flag


def test_bench_random_weights_draft_step_only():
    r = CliRunner().invoke(app, ["bench", "--model", "glm5-tiny", "--random-weights", "--draft-vocab-sizes", "0,64",
                                 "--draft-context", "32", "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["rows"] == [] and [d["draft_vocab"] for d in doc["draft_steps"]] == [None, 64]
    full, sub = doc["draft_steps"]
    assert sub["bytes"]["lm_head"] == full["bytes"]["lm_head"] * 64 // 256


def test_bench_steps_at_batch_sizes():
    """--step-batch-sizes: each draft vocabulary's step and the target step at every batch, their
    bytes the batch's (sizing.batch_step_bytes: weights once, every sequence's cache rows, the
    routed experts the batch touches)."""
    from glm5mtp_cli.diagnostics.sizing import batch_step_bytes, routed_expert_bytes, target_step_bytes

    r = CliRunner().invoke(app, ["bench", "--model", "glm5-tiny", "--random-weights", "--draft-vocab-sizes", "0,64",
                                 "--step-batch-sizes", "1,3", "--draft-context", "32", "--target-layers", "2",
                                 "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert [(d["draft_vocab"], d["batch"]) for d in doc["draft_steps"]] == [(None, 1), (None, 3), (64, 1), (64, 3)]
    assert [t["batch"] for t in doc["target_steps"]] == [1, 3] and doc["target_step"] == doc["target_steps"][0]
    one, three = doc["draft_steps"][:2]
    assert one["bytes"]["total"] < three["bytes"]["total"] < 3 * one["bytes"]["total"]
    cfg = resolve_config("glm5-tiny")[0]
    step = target_step_bytes(cfg.with_layers(2), 4, 32)
    want = batch_step_bytes(step, routed_expert_bytes(cfg.with_layers(2), 4)["target"], 3, 3, cfg.n_routed_experts,
                            cfg.num_experts_per_tok)
    assert doc["target_steps"][1]["bytes"] == {**step, "total": int(want)}
    r = CliRunner().invoke(app, ["bench", "--model", "glm5-tiny", "--random-weights", "--step-batch-sizes", "0",
                                 "--device", "cpu"])
    assert r.exit_code == 2 and "--step-batch-sizes" in r.output


def test_bench_kernels_breakdown():
    """--kernels: each step carries its profiled top kernels (CPU: operators), shares of their sum."""
    r = CliRunner().invoke(app, ["bench", "--model", "glm5-tiny", "--random-weights", "--draft-context", "32",
                                 "--device", "cpu", "--kernels", "--target-layers", "3", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    for step in (doc["draft_step"], doc["target_step"]):
        k = step["kernels"]
        assert k["steps"] == 5 and 0 < k["total_ms_per_step"] and len(k["top"]) == 12 and k["kinds"] >= 12
        shares = [row["share"] for row in k["top"]]
        assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1 + 1e-9
        assert any(row["name"] in ("aten::mm", "aten::bmm", "aten::addmm") for row in k["top"])
    plain = json.loads(CliRunner().invoke(app, ["bench", "--model", "glm5-tiny", "--random-weights", "--draft-context",
                                                "32", "--device", "cpu", "--target-layers", "0", "--json"]).stdout)
    assert plain["draft_step"]["kernels"] is None


def test_bench_random_fp8_draft_step_floor_counts_fp8():
    """--fp8: the random drafter holds FP8 weights, and the floor counts 1 byte + block scales for them
    (the lm_head stays unquantized)."""
    from glm5mtp_cli.checkpoint.resolve import resolve_config
    from glm5mtp_cli.diagnostics.step_bench import random_drafter
    from glm5mtp_cli.models.fp8 import fp8_config
    from glm5mtp_cli.models.fp8 import Fp8Linear

    args = ["bench", "--model", "glm5-tiny", "--random-weights", "--draft-context", "32", "--device", "cpu",
            "--dtype", "bf16", "--json"]
    plain, quant = (json.loads(CliRunner().invoke(app, args + extra).stdout) for extra in ([], ["--fp8"]))
    assert quant["fp8_weights"] and not plain["fp8_weights"]
    assert quant["draft_step"]["bytes"]["lm_head"] == plain["draft_step"]["bytes"]["lm_head"]
    assert quant["draft_step"]["bytes"]["mtp_weights"] < 0.7 * plain["draft_step"]["bytes"]["mtp_weights"]
    cfg = fp8_config(resolve_config("glm5-tiny")[0])
    assert quant["draft_step"]["bytes"] == draft_step_bytes(cfg, 2, 32)
    mtp, _, head = random_drafter(cfg, torch.device("cpu"), torch.bfloat16)
    assert isinstance(mtp.block.self_attn.kv_b_proj, Fp8Linear) and not isinstance(head, Fp8Linear)
    r = CliRunner().invoke(app, ["bench", "--model", "glm5-tiny", "--fp8", "--device", "cpu"])
    assert r.exit_code != 0 and "--fp8" in r.output


def test_bench_tp2_on_gloo(tiny):
    """Spawned ranks run in a subprocess (as a user runs them), not inside the test process."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "glm5mtp_cli.cli", "bench", "--model", tiny, "--gammas", "0,2",
                        "--batch-sizes", "1", "--max-new-tokens", "4", "--repeats", "1", "--draft-context", "16",
                        "--device", "cpu", "--tp", "2", "--json"], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert doc["tp"] == 2 and [row["system"] for row in doc["rows"]] == ["gamma 0", "gamma 2"]


def _threads_at_exit(out_dir: str) -> None:
    """A spawned rank's work: imports what torch._dynamo imports lazily at a model's first build
    (after the group exists), and records the process's threads at its interpreter's exit, after
    launch's teardown."""
    import atexit
    import os

    import torch.distributed.nn.functional  # noqa: F401

    def record():
        names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
        with open(os.path.join(out_dir, f"{os.getpid()}.txt"), "w") as f:
            f.write("\n".join(names))

    atexit.register(record)


def test_tp_ranks_exit_with_the_group_torn_down(tmp_path):
    """test_bench_tp2_on_gloo's rank 1 died of SIGABRT now and then under load: the group that
    destroy_process_group left alive (torch.distributed.nn.functional's defaults held it) was torn
    down by the interpreter's exit while the peer rank exited. No gloo thread is left by then."""
    from glm5mtp_cli.engine import launch

    launch.spawn(2, "gloo", _threads_at_exit, str(tmp_path))
    threads = [p.read_text().split() for p in tmp_path.glob("*.txt")]
    assert len(threads) == 2 and all(names for names in threads)
    assert not [n for names in threads for n in names if "gloo" in n or "tcpstore" in n], threads


def test_glm5next_transformers_baseline_is_the_same_model():
    """bench's baseline for GLM-5-Next (transformers' ConditionalGeneration over the flat text config)
    loads the shipped checkpoint's weights: its greedy tokens are glm5mtp's gamma-0 tokens."""
    pytest.importorskip("transformers", minversion="5.24")
    import torch

    from glm5mtp_cli.engine.run import run_generate
    from glm5mtp_cli.engine.runtime import load_runtime
    from glm5mtp_cli.engine.sampling import SamplingParams
    from glm5mtp_cli.core.families import family_of

    rt = load_runtime(ModelSpec("glm5next-nano", "cpu", "fp32"), with_mtp=False, progress=False)
    prompt = rt.tokenizer.encode("def fibonacci(n):")
    results = run_generate(rt, [prompt], EngineConfig(gamma=0, max_new_tokens=12, sampling=SamplingParams(), batch_size=1, max_seq_len=64, alloc="budget", draft_conf_tau=None, eos_ids=(), graphs="eager"))[0]
    model = family_of(rt.cfg).transformers_model(str(rt.resolved.folder), torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert out[0, len(prompt):].tolist() == results[0].tokens


@pytest.mark.parametrize("extra", [[], ["--schedule", "static"], ["--gamma-policy", "adaptive"]])
def test_bench_over_a_prompt_set(spec_ckpt, extra):
    """--num-prompts: N prompts through each batch size's slots, with TTFT/TPOT percentiles."""
    folder, _ = spec_ckpt
    r = CliRunner().invoke(app, ["bench", "--model", str(folder), "--gammas", "0,2", "--batch-sizes", "2",
                                 "--num-prompts", "5", "--max-new-tokens", "4", "--repeats", "1", "--no-transformers",
                                 "--draft-context", "16", "--device", "cpu", "--json", *extra])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["rows"]
    assert [row["prompts"] for row in rows] == [5, 5]
    for row in rows:
        assert row["ttft_ms_p99"] >= row["ttft_ms_p50"] > 0 and row["tpot_ms_p99"] >= row["tpot_ms_p50"] > 0
    assert rows[1]["system"] == "gamma 2" + {"": "", "static": ", static", "adaptive": " adaptive"}[
        extra[1] if extra else ""]


def test_bench_runs_both_policies_in_turns(spec_ckpt, monkeypatch):
    """--gamma-policy fixed,adaptive: gamma 0 once, each gamma > 0 under each policy; every round
    runs each configuration once (warm-up round first), so a drifting machine reaches all alike."""
    from glm5mtp_cli.diagnostics import bench

    order = []
    real = bench.run_generate

    def spy(rt, work, config, **kw):
        order.append((config.gamma, config.gamma_policy))
        return real(rt, work, config, **kw)

    monkeypatch.setattr(bench, "run_generate", spy)
    folder, _ = spec_ckpt
    r = CliRunner().invoke(app, ["bench", "--model", str(folder), "--gammas", "0,2", "--batch-sizes", "2",
                                 "--num-prompts", "3", "--max-new-tokens", "4", "--repeats", "2", "--no-transformers",
                                 "--draft-context", "16", "--device", "cpu", "--json",
                                 "--gamma-policy", "fixed,adaptive"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["rows"]
    assert [(x["system"], x["gamma_policy"]) for x in rows] == [
        ("gamma 0", "fixed"), ("gamma 2", "fixed"), ("gamma 2 adaptive", "adaptive")]
    assert order == [(0, "fixed"), (2, "fixed"), (2, "adaptive")] * 3
    assert rows[2]["speedup_vs_gamma0"] == rows[2]["e2e_tokens_per_s"] / rows[0]["e2e_tokens_per_s"]
    assert sum(rows[1]["gamma_steps"].values()) > 0 and set(rows[1]["gamma_steps"]) == {"2"}


def test_bench_refuses_an_unknown_policy_in_one_line(spec_ckpt):
    folder, _ = spec_ckpt
    r = CliRunner().invoke(app, ["bench", "--model", str(folder), "--gamma-policy", "fixed,sometimes",
                                 "--device", "cpu"])
    assert r.exit_code == 2 and "--gamma-policy takes fixed, adaptive" in r.output


def test_host_time_diagnostic_runs():
    """diagnostics/host_time (the step loop's host time, forwards excluded): a number, and the
    forwards' timing hook taken off again."""
    from glm5mtp_cli.diagnostics.host_time import host_us_per_step
    from glm5mtp_cli.engine import static

    run = static.StaticForward.run
    assert host_us_per_step(gamma=2, batch=2, requests=4, new_tokens=4, repeats=1) > 0
    assert static.StaticForward.run is run


def test_step_phases_diagnostic_times_each_phase_and_takes_its_wrappers_off(capsys, spec_ckpt):
    """diagnostics/step_phases around bench: a row per gamma with each phase's microseconds a step,
    drafting only where there is a drafter, the admissions' seconds, and no observer left after."""
    from glm5mtp_cli.diagnostics import step_phases
    from glm5mtp_cli.engine import hooks

    folder, _ = spec_ckpt
    code = step_phases.main(["bench", "--model", str(folder), "--device", "cpu", "--batch-sizes", "2",
                             "--gammas", "0,2", "--max-new-tokens", "5", "--num-prompts", "3", "--repeats", "1",
                             "--no-transformers", "--json"])
    assert code == 0
    rows = {r["gamma"]: r for r in map(json.loads, capsys.readouterr().err.strip().splitlines()[-2:])}
    assert set(rows) == {0, 2} and all(r["slots"] == 2 and r["steps"] > 0 for r in rows.values())
    for r in rows.values():
        phases = ("accept_us", "commit_device_us", "read_us", "commit_us", "finish_us")
        assert r["step_us"] >= sum(r[p] for p in phases) > 0 and r["runner.verify_us"] > 0
        assert r["admit_calls"] >= 1 and r["admit_s"] > 0
    assert "draft_us" in rows[2] and "draft_us" not in rows[0]
    assert not hooks._installed


def _doc(rows, recs):
    return {"device": "cuda:0", "dtype": "bfloat16", "max_new_tokens": 256, "repeats": 3, "rows": rows,
            "recommendation": recs}


def _row(batch, system, gamma, policy="fixed", predicted=None):
    """A bench row with the widest numbers a big batch gives (tokens/s in the tens of thousands)."""
    hf = gamma is None
    return {"batch": batch, "prompts": 164, "system": system, "gamma": gamma, "gamma_policy": policy,
            "e2e_tokens_per_s": 41234.5, "decode_tokens_per_s": None if hf else 52345.6,
            "predicted_decode_tokens_per_s": predicted, "mean_acceptance_length": None if hf else 3.21,
            "speedup_vs_gamma0": 1.23, "speedup_vs_transformers": 12.34, "ttft_ms_p50": None if hf else 1234.5,
            "ttft_ms_p99": None if hf else 12345.6, "tpot_ms_p50": 123.45, "tpot_ms_p99": None if hf else 234.56,
            "wall_prefill_s": None if hf else 123.45, "wall_decode_s": None if hf else 1234.56,
            "graph_capture_ms": None if hf else 12345.0, "gamma_steps": {"0": 5, "3": 95} if policy == "adaptive" else {}}


def _render(width, fn, *args) -> str:
    import io

    from rich.console import Console

    buf = io.StringIO()
    fn(Console(file=buf, width=width), *args)
    return buf.getvalue()


def test_bench_tables_fit_80_columns_with_every_header_whole():
    from glm5mtp_cli.commands.bench import print_rows

    rows = [_row(64, "transformers", None), _row(64, "gamma 0, static", 0, predicted=50000.0),
            _row(64, "gamma 3 adaptive, static", 3, "adaptive"), _row(64, "gamma 3, static", 3, predicted=61234.5)]
    rec = {"batch": 64, "best_gamma": 3, "predicted_tokens_per_s": 61234.5, "measured_tokens_per_s": 52345.6,
           "model_best_gamma": 3, "model_best_tokens_per_s": 61234.5, "model_best_measured_tokens_per_s": 52345.6}
    out = _render(80, print_rows, _doc(rows, [rec]))
    lines = out.splitlines()
    assert all(len(line) <= 80 for line in lines) and "…" not in out, out
    # each header whole: a two-line one's halves on the header's two lines, ending in the same column
    for title, heads in (("tokens/s", ["batch", "prompts", "system", "e2e\ntok/s", "decode\ntok/s", "pred.\ndecode",
                                       "acc\nlen", "vs\ngamma 0", "vs\nHF"]),
                         ("latency, ms", ["batch", "system", "TTFT\np50", "TTFT\np99", "TPOT\np50", "TPOT\np99"]),
                         ("wall time, s", ["batch", "system", "prefill", "run", "capture"])):
        start = next(i for i, line in enumerate(lines) if line.strip().endswith(title))
        rule = next(i for i in range(start, len(lines)) if "───" in lines[i])
        top, bottom = lines[rule - 2], lines[rule - 1]
        for head in heads:
            a, b = head.split("\n") if "\n" in head else ("", head)
            ends_b = {m.end() for m in re.finditer(r"(?<!\S)" + re.escape(b) + r"(?= |$)", bottom)}
            ends_a = {m.end() for m in re.finditer(r"(?<!\S)" + re.escape(a) + r"(?= |$)", top)} if a else ends_b
            assert ends_a & ends_b, (title, head, top, bottom)
    # every value is still there: the wall-time split, both percentiles, the adaptive row's gamma mix
    for value in ("41234.5", "52345.6", "61234.5", "12345.6", "234.56", "123.45", "1358.01", "12.35", "12.34",
                  "5 at gamma 0, 95 at gamma 3"):
        assert value in " ".join(out.split()), (value, out)
    assert "gamma 3 adaptive," in out and "static" in out  # a long system name wraps, whole words


def test_bench_recommends_what_its_table_measured_fastest():
    """The recommendation follows the table; the model's pick is said after it where it differs: a
    gamma that measured slower, or one not run (extrapolated, to measure)."""
    from glm5mtp_cli.commands.bench import print_rows

    rows = [_row(8, "gamma 0", 0), _row(8, "gamma 3", 3)]
    rec = {"batch": 8, "best_gamma": 3, "predicted_tokens_per_s": 1100.0, "measured_tokens_per_s": 1000.0,
           "model_best_gamma": 2, "model_best_tokens_per_s": 1200.0, "model_best_measured_tokens_per_s": None}
    out = " ".join(_render(80, print_rows, _doc(rows, [rec])).split())
    said = out.index("recommended gamma 3 at batch 8: measured 1000.0 decode tokens/s, the fastest run (the model "
                     "predicts 1100.0)")
    assert said < out.index("the model predicts gamma 2, not run at batch 8, at 1200.0: extrapolated, not measured; "
                            "measure it with --gammas 2 --batch-sizes 8"), out
    rec.update(model_best_gamma=0, model_best_tokens_per_s=1150.0, model_best_measured_tokens_per_s=900.0)
    out = " ".join(_render(80, print_rows, _doc(rows, [rec])).split())
    assert "the model's pick was gamma 0 (predicted 1150.0), but it measured 900.0: the measurement decides" in out
    rec.update(model_best_gamma=3)
    out = " ".join(_render(80, print_rows, _doc(rows, [rec])).split())
    assert "the model's pick" not in out and "extrapolated" not in out


def test_kernel_names_fold_at_80_columns():
    from glm5mtp_cli.commands.bench import _print_kernels

    name = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off"
    step = {"step_ms": 1.5, "kernels": {"source": "CUDA kernels", "total_ms_per_step": 1.2, "calls_per_step": 40,
                                        "kinds": 12, "steps": 5, "top": [{"name": name, "calls_per_step": 4,
                                                                          "ms_per_step": 0.5, "share": 0.4}]}}
    out = _render(80, _print_kernels, "draft step", step)
    assert "…" not in out and all(len(line) <= 80 for line in out.splitlines()), out
    lines = out.splitlines()
    rule = next(i for i, line in enumerate(lines) if "───" in line)
    pieces = [line.split()[0] for line in lines[rule + 1:] if line.strip()][:-1]  # the kernel cell; the caption last
    assert "".join(pieces) == name[:90] and len(pieces) > 1, out  # folded onto lines, every character kept


@pytest.fixture
def transformers_warnings():
    """transformers' logging at its default level, warnings included (an earlier test may have raised it)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()
    yield hf_logging.get_logger("transformers.modeling_utils")
    hf_logging.set_verbosity(level)


def test_quiet_transformers_holds_warnings_and_shows_errors(capfd, transformers_warnings):
    import logging

    from transformers.utils import logging as hf_logging

    from glm5mtp_cli.diagnostics.bench import quiet_transformers

    log, root = transformers_warnings, logging.getLogger("transformers")
    handlers, bars = list(root.handlers), hf_logging.is_progress_bar_enabled()
    with quiet_transformers():
        # transformers' own handler (the terminal) is off and ours, which holds what it gets, is on; whatever
        # else is attached (pytest's log capture, by version) is left alone
        added = [h for h in root.handlers if h not in handlers]
        removed = [h for h in handlers if h not in root.handlers]
        assert [type(h) for h in added] == [logging.handlers.MemoryHandler]
        assert [type(h) for h in removed] == [logging.StreamHandler]
        assert not hf_logging.is_progress_bar_enabled()
        log.warning("load report: held")
    assert "load report: held" not in capfd.readouterr().err
    assert set(root.handlers) == set(handlers) and hf_logging.is_progress_bar_enabled() == bars  # all as it was
    with quiet_transformers():
        log.warning("context of the error")
        log.error("a real error")
    err = capfd.readouterr().err
    assert "a real error" in err and "context of the error" in err, err
    with pytest.raises(RuntimeError), quiet_transformers():
        log.warning("see the report above")
        raise RuntimeError("load failed")
    assert "see the report above" in capfd.readouterr().err
