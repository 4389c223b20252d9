"""`glm5mtp plan`: its bytes are sizing's (and the loaded model's), its model is monotonic where it must
be, gamma 0 is the no-speculation baseline, bad input is one line, the exports parse. No weights are
loaded but for one glm5-nano check."""

from __future__ import annotations

import dataclasses
import json
import math
import shlex

import pytest
import torch
from typer.testing import CliRunner

from glm5mtp_cli.checkpoint.resolve import resolve_config
from glm5mtp_cli.cli import app
from glm5mtp_cli.diagnostics import calibration, sizing
from glm5mtp_cli.diagnostics.hardware import TABLE
from glm5mtp_cli.diagnostics.info import model_info
from glm5mtp_cli.diagnostics.plan import PlanConfig, forward, model_sizes, run_plan, step_seconds
from glm5mtp_cli.diagnostics.plan_exports import exports


def _config(model: str, **kw) -> PlanConfig:
    base = dict(model=model, layers=None, fp8=False, draft_vocab=None, acceptance=(0.9, 0.8, 0.7),
                acceptance_source="test", hardware=TABLE["h200"], calibration=calibration.load(), tp=1,
                context=256, budget=512, batch_sizes=(1, 8, 64), gammas=(0, 1, 2, 3))
    return PlanConfig(**{**base, **kw})


@pytest.mark.parametrize("model", ["glm5-nano", "glm5next-nano"])
def test_batch1_bytes_are_sizings(model):
    cfg, _ = resolve_config(model)
    c = _config(model)
    s = model_sizes(cfg, c)
    assert forward("decode", 1, 1, s, c).bytes == sizing.target_step_bytes(cfg, 2, c.context)["total"]
    assert forward("draft", 1, 1, s, c).bytes == sizing.draft_step_bytes(cfg, 2, c.context)["total"]
    assert s.weights_bytes == sizing.predicted_weight_bytes(cfg, torch.bfloat16)
    state = sizing.state_bytes(cfg, torch.bfloat16, c.budget + max(c.gammas), 16, with_drafter=True)
    assert s.state_bytes == sum(state.values()) > 0
    # more tokens touch more experts, never more than all of them
    routed = s.routed["target"]
    assert routed > 0 and forward("decode", 8, 1, s, c).bytes > forward("decode", 1, 1, s, c).bytes
    every = routed * cfg.n_routed_experts / cfg.num_experts_per_tok
    batch1 = sizing.target_step_bytes(cfg, 2, c.context)["total"]
    assert forward("prefill", 1, 1024, s, c).bytes <= batch1 - routed + every


def test_bytes_and_flops_equal_the_loaded_glm5_nano():
    from glm5mtp_cli.engine.config import ModelSpec
    from glm5mtp_cli.engine.runtime import load_runtime

    rt = load_runtime(ModelSpec("glm5-nano", "cpu", "bf16"), progress=False)
    cfg = rt.cfg
    s = model_sizes(cfg, _config("glm5-nano"))
    assert s.weights_bytes == sum(rt.weight_bytes().values())
    info = model_info(cfg)
    loaded = sum(t.numel() for m in (rt.target, rt.mtp) for t in m.state_dict().values())
    assert loaded == sum(p.params for parts in (info.target, info.mtp) for p in parts.values())
    routed = info.target["routed experts"].params
    dense = sum(p.params for k, p in info.target.items() if k not in ("routed experts", "embeddings"))
    assert s.target_params == dense + routed * cfg.num_experts_per_tok // cfg.n_routed_experts
    c = _config("glm5-nano")
    assert forward("decode", 1, 1, s, c).flops == 2 * s.target_params


def test_more_bandwidth_is_never_slower_and_gamma0_is_the_baseline():
    cfg, _ = resolve_config("glm5")
    c = _config("glm5", fp8=True, tp=8, context=4096, batch_sizes=(1, 8, 64, 256))
    from glm5mtp_cli.models.fp8 import fp8_config

    cfg8 = fp8_config(cfg)
    s = model_sizes(cfg8, c)
    faster = dataclasses.replace(c, hardware=dataclasses.replace(c.hardware, memory_bytes_per_s=2 * c.hardware.memory_bytes_per_s))
    for b in c.batch_sizes:
        for g in c.gammas:
            assert step_seconds(b, g, s, faster) <= step_seconds(b, g, s, c)
    doc = run_plan(cfg8, c)
    for row in doc["batches"]:
        g0 = next(g for g in row["gammas"] if g["gamma"] == 0)
        assert g0["speedup"] == 1.0
        assert g0["tokens_per_s"] == row["batch_size"] / step_seconds(row["batch_size"], 0, s, c)
        assert math.isclose(g0["tpot_ms"], step_seconds(row["batch_size"], 0, s, c) * 1e3)
    assert not doc["validated"] and "not validated on hardware here" in doc["notes"][0]  # tp 8


def test_a_step_drafts_from_a_catch_up_as_wide_as_its_verify():
    """A gamma-3 step over 8 sequences: the catch-up forward of 4 rows a sequence (the engine's,
    padded to its largest gamma's width), 2 chained one-row drafts, a verify of 4 rows; gamma 0 is
    the decode alone; the step's time is the sum of its forwards'."""
    from glm5mtp_cli.diagnostics.plan import step_forwards

    cfg, _ = resolve_config("glm5")
    c = _config("glm5", batch_sizes=(8,))
    s = model_sizes(cfg, c)
    forwards = step_forwards(8, 3, s, c)
    assert [(f.kind, f.rows, n) for f, n in forwards] == [("draft", 32, 1), ("draft", 8, 2), ("verify", 32, 1)]
    assert forwards[0][0].bytes > forwards[1][0].bytes  # 32 tokens touch more routed experts than 8
    assert math.isclose(step_seconds(8, 3, s, c), sum(f.seconds * n for f, n in forwards))
    assert [(f.kind, f.rows) for f, _ in step_forwards(8, 0, s, c)] == [("decode", 8)]


def test_one_speedup_model_with_bench():
    """plan's tokens/s is recommend's formula on plan's step cost."""
    from glm5mtp_cli.diagnostics.recommend import predict

    cfg, _ = resolve_config("glm5-nano")
    c = _config("glm5-nano", batch_sizes=(8,))
    s = model_sizes(cfg, c)
    verify = step_seconds(8, 0, s, c)
    per_pos = [0.9, 0.9 * 0.8, 0.9 * 0.8 * 0.7]
    by_gamma = predict(per_pos, verify, 0.0, 8)  # a zero-cost draft: E(g) alone
    assert math.isclose(by_gamma[0], run_plan(cfg, c)["batches"][0]["gammas"][0]["tokens_per_s"])


def test_exports_parse_and_name_the_gamma():
    batches = [{"batch_size": 1, "best_gamma": 3, "gammas": []}, {"batch_size": 64, "best_gamma": 1, "gammas": []}]
    ex = exports(batches, 128, None)
    assert ex["gamma"] == 3
    assert json.loads(ex["vllm"]) == {"method": "mtp", "num_speculative_tokens": 3}
    words = shlex.split(ex["sglang"])
    assert words[words.index("--speculative-num-steps") + 1] == "3"
    assert words[words.index("--speculative-num-draft-tokens") + 1] == "4"
    try:
        import yaml
    except ImportError:
        pytest.skip("pyyaml is not installed: the TensorRT-LLM YAML is not parsed")
    conf = yaml.safe_load(ex["trtllm"])["speculative_config"]
    assert conf["decoding_type"] == "MTP" and conf["max_draft_len"] == 3
    assert conf["draft_len_schedule"] == {1: 3, 64: 1} and conf["max_concurrency"] == 127


def test_plan_json_and_table():
    r = CliRunner().invoke(app, ["plan", "--model", "glm5-nano", "--acceptance", "0.9,0.8", "--batch-sizes", "1,8",
                                 "--gammas", "0,2", "--context", "128", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert [b["batch_size"] for b in doc["batches"]] == [1, 8]
    for b in doc["batches"]:
        assert b["best_gamma"] in (0, 2) and {"gamma", "tpot_ms", "tokens_per_s", "speedup"} <= set(b["gammas"][0])
    assert set(doc["exports"]) >= {"vllm", "sglang", "trtllm"}
    r = CliRunner().invoke(app, ["plan", "--model", "glm5", "--fp8", "--tp", "8", "--acceptance", "0.9",
                                 "--hardware", "b200", "--batch-sizes", "1"])
    assert r.exit_code == 0, r.output
    assert "not validated on hardware here" in r.output and "--speculative-config" in r.output


def test_plot_or_one_line_naming_matplotlib(tmp_path):
    png = tmp_path / "plan.png"
    r = CliRunner().invoke(app, ["plan", "--model", "glm5-nano", "--acceptance", "0.9", "--batch-sizes", "1,8",
                                 "--plot", str(png)])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert r.exit_code == 2 and "matplotlib" in r.output and len(r.output.strip().splitlines()) == 1, r.output
        return
    assert r.exit_code == 0 and png.stat().st_size > 0, r.output


def test_acceptance_file_reads_acceptance_json(tmp_path):
    doc = {"runs": [{"temperature": 0.0, "gamma": 0, "acceptance": None},
                    {"temperature": 0.0, "gamma": 2, "acceptance": {"per_position": [0.8, 0.4]}}]}
    f = tmp_path / "acc.json"
    f.write_text(json.dumps(doc))
    r = CliRunner().invoke(app, ["plan", "--model", "glm5-nano", "--acceptance-file", str(f), "--json",
                                 "--batch-sizes", "1", "--context", "64"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["acceptance"]["conditional"] == [0.8, 0.5]
    f.write_text(json.dumps({"acceptance": {"gamma": 2, "per_position": [0.9, 0.45]}}))  # generate --json's
    r = CliRunner().invoke(app, ["plan", "--model", "glm5-nano", "--acceptance-file", str(f), "--json",
                                 "--batch-sizes", "1", "--context", "64"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["acceptance"]["conditional"] == [0.9, 0.5]


def test_calibrate_and_check_on_raw_h200_files(tmp_path):
    out = tmp_path / "cal.json"
    r = CliRunner().invoke(app, ["plan", "--calibrate", "profiles/glm5/fp8_h200/bench_bf16_steps_run29.json",
                                 "--check", "profiles/glm5/fp8_h200/bench_fp8_steps_run29.json", "--out", str(out),
                                 "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert [x["what"] for x in doc["check"]] == ["draft step fp8", "target step (4 layers) fp8"]
    assert all(abs(x["error"]) < 0.5 for x in doc["check"])
    assert calibration.load(out).kernels["glm_moe_dsa"]["draft"] == 148


def test_a_one_file_calibration_says_1_file(tmp_path):
    """The fit's line and the plan's calibration line count the files as words do ('1 files' was said)."""
    out = tmp_path / "cal.json"
    r = CliRunner().invoke(app, ["plan", "--calibrate", "profiles/glm5/fp8_h200/bench_bf16_steps_run29.json",
                                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "fitted on h200 (1 file, commit " in text and "1 files" not in text, r.output
    r = CliRunner().invoke(app, ["plan", "--model", "glm5-nano", "--acceptance", "0.9", "--batch-sizes", "1",
                                 "--calibration", str(out)])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "(1 file); acceptance from --acceptance" in text and "1 files" not in text, r.output


def test_bad_input_is_one_line(tmp_path):
    bad = tmp_path / "hw.json"
    bad.write_text('{"name": "x", "memory_bytes_per_s": 1e12}')
    junk = tmp_path / "junk.json"
    junk.write_text("{not json")
    neg = tmp_path / "neg.json"
    neg.write_text(json.dumps({k: 1.0 for k in ("memory_bytes_per_s", "bf16_flops", "fp8_flops", "memory_bytes",
                                               "link_bytes_per_s")} | {"link_latency_s": -1}))
    base = ["plan", "--model", "glm5-nano", "--acceptance", "0.9"]
    for args, needle in ((base + ["--hardware", "tpu9"], "unknown"),
                         (base + ["--hardware-file", str(bad)], "missing"),
                         (base + ["--hardware-file", str(junk)], "not JSON"),
                         (base + ["--hardware-file", str(neg)], "link_latency_s"),
                         (["plan", "--model", "glm5-nano", "--acceptance", "0.9,x"], "--acceptance"),
                         (["plan", "--model", "glm5-nano", "--acceptance", "1.5"], "--acceptance"),
                         (["plan", "--model", "glm5-nano"], "--acceptance 0.9,0.8,0.7"),
                         (base + ["--batch-sizes", "0"], "--batch-sizes"),
                         (base + ["--acceptance-file", str(junk)], "one of them"),
                         (["plan", "--model", "glm5-nano", "--acceptance-file", str(junk)], "not JSON"),
                         (["plan", "--calibrate", str(junk)], "not JSON")):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 2, (args, r.output)
        assert needle in r.output and "Traceback" not in r.output, (args, r.output)
        assert len(r.output.strip().splitlines()) == 1, r.output


def test_calibrate_refits_the_shipped_values_from_its_files():
    """The shipped calibration is what `plan --calibrate` fits on the files it names (reproducible)."""
    from glm5mtp_cli.diagnostics import plan_fit

    shipped = calibration.load()
    files = [f["path"] for f in shipped.fitted["files"]]
    measured = [m for f in files for m in calibration.read_measurements(f)]
    refit = plan_fit.fit(measured, TABLE[shipped.hardware], files)
    for key, v in shipped.bandwidth_efficiency.items():
        assert math.isclose(refit.bandwidth_efficiency[key], v, rel_tol=1e-6)
    assert math.isclose(refit.per_kernel_s, shipped.per_kernel_s, rel_tol=1e-6)
    assert math.isclose(refit.reread_fraction, shipped.reread_fraction, rel_tol=1e-6)
    assert refit.kernels == shipped.kernels


def test_the_fit_recovers_a_per_sequence_draft_cost():
    """Runs generated from a known calibration are fitted back to it, the per-sequence draft cost
    included (identified by drafting and decoding runs at batch > 1), and a draft forward pays it."""
    from glm5mtp_cli.diagnostics import plan_fit

    hw = dataclasses.replace(TABLE["h200"], launch_s=None)
    truth = dataclasses.replace(calibration.load(), bandwidth_efficiency={"draft": 0.7, "decode": 0.6},
                                per_kernel_s=2e-6, host_step_s=0.0, host_forward_s=1e-4, host_sequence_s=2e-5,
                                draft_sequence_s=3e-5, reread_fraction=0.4)
    shape = dict(model="glm5", layers=4, fp8=False, context=128, source="synthetic")  # real dimensions
    counts = {"draft": 150.0, "decode": 90.0 * 4}  # a step's kernels, as bench --kernels counts them
    truth = dataclasses.replace(truth, kernels={"glm_moe_dsa": {"draft": 150.0, "target_per_layer": 90.0}})
    steps = [calibration.Measurement(what=k, kind=k, seconds=0.0, kernels=counts[k], **shape) for k in counts]
    runs = [calibration.Measurement(what=f"b{b} g{g}", kind="run", seconds=0.0, seqs=b, gamma=g, **shape)
            for b in (1, 8, 32) for g in (0, 3)]
    measured = [dataclasses.replace(m, seconds=plan_fit.predict_seconds(m, hw, truth)) for m in steps + runs]
    fitted = plan_fit.fit(measured, hw, [])
    assert math.isclose(fitted.draft_sequence_s, 3e-5, rel_tol=1e-3)
    assert math.isclose(fitted.host_sequence_s, 2e-5, rel_tol=1e-3)
    assert math.isclose(fitted.reread_fraction, 0.4, rel_tol=1e-3)
    assert all(abs(r["error"]) < 1e-6 for r in fitted.residuals)
    c = _config("glm5-nano", calibration=truth)
    s = model_sizes(resolve_config("glm5-nano")[0], c)
    assert math.isclose(forward("draft", 8, 1, s, c).times["host"] - forward("draft", 1, 1, s, c).times["host"],
                        7 * 3e-5)


def test_few_pair_moe_forwards_pay_for_repeated_expert_reads():
    """kernels/moe.py streams an expert once per (token, expert) pair: a forward of N tokens repeats
    N - E(1 - (1 - k/E)^N)/k top-k worth of expert reads, none at one token or where the grouped GEMM
    runs (kernels/moe_grouped.pays), and the calibration's reread_fraction of them cost first reads."""
    from kernels.moe_grouped import pays

    assert sizing.reread_experts_factor(1, 256, 8) == 0.0
    n = 32  # GLM-5's batch-8 gamma-3 verify: 256 pairs, the few-pair kernels
    assert not pays(n * 8, 256)
    assert math.isclose(sizing.reread_experts_factor(n, 256, 8), n - sizing.touched_experts_factor(n, 256, 8))
    assert pays(128 * 8, 256) and sizing.reread_experts_factor(128, 256, 8) == 0.0
    cfg, _ = resolve_config("glm5")
    base = _config("glm5", layers=4, context=4096)
    free, paid = (dataclasses.replace(base, calibration=dataclasses.replace(base.calibration, reread_fraction=f))
                  for f in (0.0, 0.5))
    s = model_sizes(cfg.with_layers(4), base)
    one, wide = forward("verify", 8, 4, s, free), forward("verify", 8, 4, s, paid)
    assert one.bytes == wide.bytes and wide.reread_bytes == one.reread_bytes > 0
    eff = base.hardware.memory_bytes_per_s * base.calibration.efficiency("verify", False)
    assert math.isclose(wide.times["bandwidth"] - one.times["bandwidth"], 0.5 * wide.reread_bytes / eff)
    assert forward("decode", 1, 1, s, paid).reread_bytes == 0.0


def test_a_runs_step_is_its_decode_time_over_its_steps(tmp_path):
    """A run's step is its decode wall time over its steps, at the sequences a step decoded on average
    (slots stand idle between a finish and the next admission); a document without step counts
    reads every slot as busy."""
    row = {"system": "gamma 3", "gamma": 3, "batch": 8, "gamma_policy": "fixed", "prompts": 20,
           "decode_tokens_per_s": 1000.0, "wall_decode_s": 2.0, "mean_acceptance_length": 4.0,
           "gamma_steps": {"3": 100}}
    f = tmp_path / "bench.json"
    f.write_text(json.dumps({"model": "glm5-nano", "max_new_tokens": 128, "rows": [row]}))
    (m,) = calibration.read_measurements(f)
    assert math.isclose(m.seconds, 0.02) and math.isclose(m.seqs, 5.0)  # 2000 tokens / 4 a sequence-step / 100
    assert math.isclose(m.tokens_per_step / m.seconds, 1000.0)
    del row["gamma_steps"]
    f.write_text(json.dumps({"model": "glm5-nano", "max_new_tokens": 128, "rows": [row]}))
    (m,) = calibration.read_measurements(f)
    assert math.isclose(m.seconds, 8 * 4.0 / 1000.0) and m.seqs == 8


def test_check_alone_predicts_with_a_calibration_on_other_hardware():
    """--check without --calibrate predicts the files from --calibration (default: the shipped one)
    on --hardware: how a calibration carries over to another GPU's runs."""
    f = "profiles/glm5/plan_h100_f971bb8/steps_glm5next_bf16.json"
    docs = {}
    for hw in ("h100", "h200"):
        r = CliRunner().invoke(app, ["plan", "--check", f, "--hardware", hw, "--json"])
        assert r.exit_code == 0, r.output
        docs[hw] = json.loads(r.output)
    assert docs["h100"]["calibration"] == dataclasses.asdict(calibration.load())
    h100, h200 = ([x["predicted_ms"] for x in docs[hw]["check"]] for hw in ("h100", "h200"))
    assert len(h100) == 8 and all(b < a for a, b in zip(h100, h200))  # more bandwidth, shorter steps
    assert all(abs(x["error"]) < 0.25 for x in docs["h100"]["check"])
    r = CliRunner().invoke(app, ["plan", "--check", f, "--out", "x.json"])
    assert r.exit_code == 2 and "--out goes with --calibrate" in r.output
    r = CliRunner().invoke(app, ["plan", "--check", "no/such.json"])
    assert r.exit_code == 2 and r.output.startswith("error: --check no/such.json")


def test_plan_with_no_arguments_shows_an_example_in_one_line():
    r = CliRunner().invoke(app, ["plan"])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert "e.g. glm5mtp plan --model glm5 --fp8 --tp 8 --hardware b200 --acceptance 0.9,0.8,0.7" in r.output
    assert "--acceptance-file FILE" in r.output and "Traceback" not in r.output


def test_plan_clips_the_context_and_budget_to_the_models_limit_with_a_note():
    """glm5-nano's limit is 2048 (max_position_embeddings): a longer context or budget is no request an
    engine serves, so the plan is made at the limit and says so, as profile does."""
    base = ["plan", "--model", "glm5-nano", "--acceptance", "0.9", "--batch-sizes", "1"]
    r = CliRunner().invoke(app, base + ["--context", "100000", "--budget", "5000", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["context"] == 2048 and doc["memory"]["budget"] == 2048
    assert ("--context: planned at 2048 (--context 100000 clipped to the model's limit, max_position_embeddings "
            "2048)") in doc["notes"]
    assert "--budget: planned at 2048 (--budget 5000 clipped to the model's limit, max_position_embeddings 2048)" \
        in doc["notes"]
    r = CliRunner().invoke(app, base + ["--json"])
    doc = json.loads(r.output)
    assert doc["context"] == 2048 and any("(the default 4096 clipped" in n for n in doc["notes"])
    assert not any(n.startswith("--budget") for n in doc["notes"])  # the default 2048 is within the limit
    r = CliRunner().invoke(app, base + ["--context", "512"])
    assert r.exit_code == 0 and "context 512" in r.output and "clipped" not in r.output, r.output
    r = CliRunner().invoke(app, base + ["--context", "100000"])
    assert "--context 100000 clipped to the model's limit" in " ".join(r.output.split()), r.output


def test_break_even_and_max_concurrency_stay_within_the_sequences_that_fit():
    """GLM-5-FP8 at tp 8 on a B200 holds 361 sequences at --budget 2048: speculation still pays there,
    so the plan says it does not stop paying up to them (not "stops at 4096"), and TensorRT-LLM gets no
    max_concurrency past them."""
    from glm5mtp_cli.diagnostics.plan import break_even_batch

    args = ["plan", "--model", "glm5", "--fp8", "--tp", "8", "--hardware", "b200", "--acceptance", "0.9,0.8,0.7",
            "--batch-sizes", "1,8,64,512"]
    r = CliRunner().invoke(app, args + ["--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    fits = doc["memory"]["sequences_per_gpu"]
    assert fits == 361 and doc["break_even_searched_up_to_batch"] == fits
    assert doc["speculation_stops_paying_at_batch"] is None
    assert "max_concurrency" not in doc["exports"]["trtllm"]
    assert "draft_len_schedule: {1: 4, 8: 4, 64: 4}" in doc["exports"]["trtllm"]  # 512 does not fit
    assert any(n.startswith("batch 512: past the 361 sequences that fit per GPU") for n in doc["notes"])
    r = CliRunner().invoke(app, args)
    assert "does not stop paying up to the 361 sequences that fit per GPU" in " ".join(r.output.split()), r.output
    # where it does stop, the batch named is never past the limit searched
    cfg, _ = resolve_config("glm5-nano")
    c = _config("glm5-nano", acceptance=(0.5,))
    s = model_sizes(cfg, c)
    stop = break_even_batch(s, c, 4096)
    assert stop is not None and stop > 2
    assert break_even_batch(s, c, stop) == stop
    assert break_even_batch(s, c, stop - 1) in (None, *range(1, stop))
    ex = exports([{"batch_size": 1, "best_gamma": 1}, {"batch_size": 8, "best_gamma": 1}], 4, 3)
    assert "max_concurrency: 3" in ex["trtllm"] and "draft_len_schedule: {1: 1}" in ex["trtllm"]
    assert exports([{"batch_size": 8, "best_gamma": 1}], None, 0)["vllm"] is None


def test_plan_tables_fit_80_columns_with_no_number_cut():
    """The tables at 80 columns: each number whole with its unit on its line (the per-forward table cut
    5,352,082 GFLOP to "5,352,0…" and wrapped "MiB" under "463.34"), up to a batch of 65536 at a
    200000-token context."""
    import io

    from rich.console import Console

    from glm5mtp_cli.commands.plan import _print

    def table(*args):
        r = CliRunner().invoke(app, ["plan", *args, "--json"])
        assert r.exit_code == 0, r.output
        buf = io.StringIO()
        _print(Console(file=buf, width=80), json.loads(r.output))
        out = buf.getvalue()
        tables = out[:out.index("memory per GPU")]  # the settings below are one line each, to paste
        assert all(len(line) <= 80 for line in tables.splitlines()) and "…" not in out, out
        return [line.split() for line in tables.splitlines()], out

    rows, out = table("--model", "glm5", "--fp8", "--tp", "8", "--hardware", "b200", "--acceptance", "0.9,0.8,0.7",
                      "--batch-sizes", "1,8,64")
    assert ["prefill", "65536", "104.56", "GiB", "5.35", "P", "5411", "2632.3", "compute"] in rows, out
    assert ["1", "draft", "1", "463.34", "MiB", "3.09", "G", "98", "0.335", "launch"] in rows, out
    rows, out = table("--model", "glm5", "--acceptance", "0.9", "--context", "200000", "--batch-sizes", "1,65536",
                      "--gammas", "0,1,16", "--hardware", "mi300x")
    assert ["prefill", "67108864", "250.36", "TiB", "5.48", "E", "5411", "8,383,872", "compute"] in rows, out
    assert ["16", "1,325,721", "159,107", "412", "0.48x", "1,699,344,359"] in rows, out
    r = CliRunner().invoke(app, ["plan", "--check", "profiles/glm5/plan_h100_f971bb8/steps_glm5next_bf16.json"],
                           env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    assert all(len(line) <= 80 for line in r.output.splitlines()) and "…" not in r.output, r.output
