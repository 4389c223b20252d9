"""`glm5mtp plan`: what the MTP drafter buys at given batch sizes on given GPUs, from the config alone
(diagnostics/plan.py's model), with the serving engines' settings for the best gamma; `--calibrate`
fits the model's efficiencies on measured `bench --json` / `generate --json` runs instead."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console

from glm5mtp_cli.commands.options import MODEL, OUTPUT, SPECULATION, JsonOpt, LayersOpt
from glm5mtp_cli.commands.plotting import check_plot, pyplot, save
from glm5mtp_cli.diagnostics.report import WIDE, fit_table
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.jsonl import read_json
from glm5mtp_cli.output_file import check_output
from glm5mtp_cli.units import fmt_bytes, plural

if TYPE_CHECKING:  # the model's module imports torch: not for --help
    from glm5mtp_cli.diagnostics.plan import PlanConfig

HARDWARE = "Hardware"
CALIBRATION = "Calibration"
FLOP_UNITS = (("M", 1e6), ("G", 1e9), ("T", 1e12), ("P", 1e15), ("E", 1e18))
DEFAULT_CONTEXT = 4096
DEFAULT_BUDGET = 2048
# plan with no acceptance: the one input that has no honest default (a guessed one would print a
# prediction nobody asked for), so the line shows how to give it
NO_ACCEPTANCE = ("plan needs the drafter's acceptance, e.g. glm5mtp plan --model glm5 --fp8 --tp 8 --hardware b200 "
                 "--acceptance 0.9,0.8,0.7 (or --acceptance-file FILE from `glm5mtp acceptance --json`)")


def _ints(text: str, flag: str, least: int) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UserError(f"{flag} {text!r}: give comma-separated whole numbers, e.g. 1,8,64") from None
    if not vals or min(vals) < least:
        raise UserError(f"{flag} {text!r}: every value must be >= {least}")
    return tuple(dict.fromkeys(vals))


def _files(values: list[str] | None) -> list[str]:
    """Repeated flags, each possibly comma-separated."""
    return [f for v in values or [] for f in v.split(",") if f.strip()]


def read_acceptance(path: Path) -> tuple[tuple[float, ...], str]:
    """Conditional rates from `acceptance --json` (its largest gamma; the first temperature), `generate
    --json` or `bench --json` (its largest fixed gamma), converted from their cumulative per-position
    rates by engine/synthetic.conditional."""
    from glm5mtp_cli.engine.synthetic import conditional

    flag = f"--acceptance-file {path}"
    doc = read_json(path, "--acceptance-file")
    found = []  # (gamma, per_position, what)
    if isinstance(doc, dict):
        runs = doc.get("runs") or []
        first_t = next((r.get("temperature") for r in runs if r.get("acceptance")), None)
        for r in runs:
            if r.get("acceptance") and r.get("temperature") == first_t:
                found.append((r["gamma"], r["acceptance"]["per_position"], f"acceptance run T={first_t}"))
        if isinstance(doc.get("acceptance"), dict):
            a = doc["acceptance"]
            found.append((a.get("gamma", 0), a.get("per_position") or [], "generate run"))
        for r in doc.get("rows") or []:
            if r.get("per_position") and r.get("gamma_policy") == "fixed":
                found.append((r["gamma"], r["per_position"], f"bench row batch {r['batch']}"))
    found = [f for f in found if f[1]]
    if not found:
        raise UserError(f"{flag}: no per-position acceptance in it (expected `acceptance --json`, "
                        "`generate --json` or `bench --json` with gamma > 0)")
    gamma, per_position, what = max(found, key=lambda f: f[0])
    rates = tuple(conditional(per_position))
    if not all(0.0 <= p <= 1.0 for p in rates):
        raise UserError(f"{flag}: per-position rates must fall from 1 towards 0, got {per_position}")
    return rates, f"{path} ({what}, gamma {gamma})"


def plan_cmd(
    model: Annotated[str, typer.Option("--model", "-m", metavar="NAME", rich_help_panel=MODEL,
                                       help="Profile, local folder or Hub repo id: only its config.json is read "
                                            "(as profile --predict-only).")] = "glm5",
    layers: LayersOpt = None,
    fp8: Annotated[bool, typer.Option("--fp8", metavar="", rich_help_panel=MODEL,
                                      help="Plan the family's FP8 checkpoint (e4m3, 128x128 block scales; FP8 "
                                           "FLOP/s).")] = False,
    draft_vocab: Annotated[Optional[int], typer.Option("--draft-vocab", metavar="K", rich_help_panel=SPECULATION,
                                                       help="The drafter's head keeps K vocabulary rows.")] = None,
    acceptance: Annotated[Optional[str], typer.Option(
        "--acceptance", metavar="P1,P2,...", rich_help_panel=SPECULATION,
        help="Conditional acceptance: Pk = P(draft k kept | drafts 1..k-1 kept); later drafts take the last "
             "P.")] = None,
    acceptance_file: Annotated[Optional[Path], typer.Option(
        "--acceptance-file", metavar="FILE", rich_help_panel=SPECULATION,
        help="Read the acceptance from `acceptance --json`, `generate --json` or `bench --json` "
             "(largest gamma).")] = None,
    gammas: Annotated[str, typer.Option("--gammas", metavar="LIST", rich_help_panel=SPECULATION,
                                        help="Gammas to plan (0: no speculation, the baseline).")] = "0,1,2,3,4",
    hardware: Annotated[str, typer.Option("--hardware", metavar="NAME", rich_help_panel=HARDWARE,
                                          help="h100, h200, b200, b300, mi300x or mi355x (figures and "
                                               "sources: diagnostics/hardware.py).")] = "h200",
    hardware_file: Annotated[Optional[Path], typer.Option(
        "--hardware-file", metavar="FILE", rich_help_panel=HARDWARE,
        help='Hardware as one JSON object: {"name", "memory_bytes_per_s", "bf16_flops", "fp8_flops" (dense), '
             '"memory_bytes", "link_bytes_per_s" (one direction), "link_latency_s", "launch_s" (per '
             'kernel), "sources": {field: text}}, SI units, numbers > 0; name, launch_s (default: the '
             'calibration\'s) and sources optional.')] = None,
    tp: Annotated[int, typer.Option("--tp", metavar="N", rich_help_panel=MODEL,
                                    help="Tensor/expert parallel ranks to plan for (heads, experts and vocabulary "
                                         "split as the family's sharding rules split them).")] = 1,
    context: Annotated[Optional[int], typer.Option("--context", metavar="TOKENS", show_default=False,
                                                   help="Cached tokens a decode step reads (and each prompt's "
                                                        "length, for TTFT) (default: 4096; at most the model's "
                                                        "limit).")] = None,
    budget: Annotated[Optional[int], typer.Option("--budget", metavar="TOKENS", show_default=False,
                                                  help="Tokens per request for the per-sequence state (sequences "
                                                       "per GPU) (default: 2048; at most the model's "
                                                       "limit).")] = None,
    batch_sizes: Annotated[str, typer.Option("--batch-sizes", metavar="LIST",
                                             help="Concurrent sequences to plan.")] = "1,8,32,64,128",
    calibration: Annotated[Optional[Path], typer.Option(
        "--calibration", metavar="FILE", rich_help_panel=CALIBRATION,
        help="Efficiencies from `plan --calibrate --out FILE` (default: the shipped fit, an H100 at the "
             "current kernels).")] = None,
    calibrate: Annotated[Optional[list[str]], typer.Option(
        "--calibrate", metavar="FILE", rich_help_panel=CALIBRATION,
        help="Fit the efficiencies on these `bench --json` / `generate --json` files (repeat or "
             "comma-separate) and print them; --hardware names what they ran on.")] = None,
    check: Annotated[Optional[list[str]], typer.Option(
        "--check", metavar="FILE", rich_help_panel=CALIBRATION,
        help="Predict these files' measurements and print the errors: from the fit with --calibrate, else "
             "from --calibration (default: the shipped one) on --hardware.")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", metavar="FILE", rich_help_panel=CALIBRATION,
                                                help="With --calibrate: write the fit as JSON there.")] = None,
    json_out: JsonOpt = False,
    plot: Annotated[Optional[Path], typer.Option("--plot", metavar="FILE.png", rich_help_panel=OUTPUT,
                                                 help="Decode tokens/s against batch size per gamma (needs "
                                                      "matplotlib).")] = None,
) -> None:
    """Predict speculation's speed and memory on given hardware, from the config alone, and print the
    serving engines' settings for the best gamma.

    Examples:

      glm5mtp plan --model glm5 --fp8 --tp 8 --hardware b200 \\
          --acceptance 0.9,0.8,0.7

      glm5mtp plan --model glm5-nano --acceptance-file acceptance.json \\
          --batch-sizes 1,8,64 --json

      glm5mtp plan --check gen.json \\
          --calibrate profiles/glm5/fp8_h200/bench_bf16_steps_run29.json
    """
    from glm5mtp_cli.diagnostics import hardware as hw_mod

    hw = hw_mod.from_file(hardware_file) if hardware_file is not None else hw_mod.named(hardware)
    if calibrate:
        _calibrate(_files(calibrate), _files(check), hw, out, json_out)
        return
    if out:
        raise UserError("--out goes with --calibrate")
    if check:
        from glm5mtp_cli.diagnostics import calibration as cal_mod

        cal = cal_mod.load(calibration)
        _report(cal, _checked(_files(check), hw, cal), hw, json_out, fitted=False)
        return
    if acceptance is None and acceptance_file is None:
        raise UserError(NO_ACCEPTANCE)
    if acceptance is not None and acceptance_file is not None:
        raise UserError("give the acceptance once: --acceptance P1,P2,... or --acceptance-file FILE (one of them)")
    for flag, value in (("--context", context), ("--budget", budget)):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    if draft_vocab is not None and draft_vocab < 1:
        raise UserError(f"--draft-vocab must be >= 1, got {draft_vocab}")
    check_plot(plot)
    from glm5mtp_cli.diagnostics import calibration as cal_mod
    from glm5mtp_cli.diagnostics.plan import PlanConfig
    from glm5mtp_cli.engine.synthetic import parse_rates

    rates, source = ((parse_rates(acceptance, "--acceptance"), "--acceptance") if acceptance is not None
                     else read_acceptance(acceptance_file))
    c = PlanConfig(model, layers, fp8, draft_vocab, rates, source, hw, cal_mod.load(calibration), tp,
                   DEFAULT_CONTEXT if context is None else context, DEFAULT_BUDGET if budget is None else budget,
                   _ints(batch_sizes, "--batch-sizes", 1), _ints(gammas, "--gammas", 0))
    _plan(c, json_out, plot, given={"--context": context, "--budget": budget})


def model_config(c: "PlanConfig"):
    """The model's config as planned (--layers, --fp8), checked against the flags: no weights read."""
    from glm5mtp_cli.checkpoint.resolve import resolve_config
    from glm5mtp_cli.core.parallel import check_tp
    from glm5mtp_cli.models.fp8 import fp8_config

    cfg, _ = resolve_config(c.model)
    if c.layers is not None:
        if not 1 <= c.layers <= cfg.num_hidden_layers:
            raise UserError(f"--layers must be in 1..{cfg.num_hidden_layers}, got {c.layers}")
        cfg = cfg.with_layers(c.layers)
    if c.fp8:
        cfg = fp8_config(cfg)
    check_tp(cfg, c.tp)
    if c.draft_vocab is not None and c.draft_vocab > cfg.vocab_size:
        raise UserError(f"--draft-vocab {c.draft_vocab}: the vocabulary has {cfg.vocab_size} tokens")
    return cfg


def within_limit(c: "PlanConfig", limit: int, given: dict) -> tuple["PlanConfig", list[str]]:
    """--context and --budget at most the model's limit (max_position_embeddings): a longer request is
    one no engine serves, so the plan is clipped to it, each clip said in a note (as profile says its
    clipped --max-seq-len). given: each flag's value as typed (None: its default)."""
    clipped, out = {}, []
    for flag, field in (("--context", "context"), ("--budget", "budget")):
        value = getattr(c, field)
        if value > limit:
            asked = f"{flag} {value}" if given[flag] is not None else f"the default {value}"
            out.append(f"{flag}: planned at {limit} ({asked} clipped to the model's limit, max_position_embeddings "
                       f"{limit})")
            clipped[field] = limit
    return dataclasses.replace(c, **clipped), out


def _plan(c: "PlanConfig", json_out: bool, plot: Path | None, given: dict) -> None:
    from glm5mtp_cli.diagnostics.plan import run_plan
    from glm5mtp_cli.diagnostics.plan_exports import exports

    cfg = model_config(c)
    c, clipped = within_limit(c, cfg.max_position_embeddings, given)
    doc = run_plan(cfg, c)
    doc["notes"] = clipped + doc["notes"]
    doc["exports"] = exports(doc["batches"], doc["speculation_stops_paying_at_batch"],
                             doc["memory"]["sequences_per_gpu"])
    if plot is not None:
        _plot(plot, doc)
        doc["plot"] = str(plot)
    if json_out:
        sys.stdout.write(json.dumps(doc) + "\n")
        return
    _print(Console(), doc)


def _print(out: Console, doc: dict) -> None:
    acc = ",".join(f"{p:.3g}" for p in doc["acceptance"]["conditional"])
    title = (f"plan: {doc['model']} ({doc['layers']} layers{', fp8' if doc['fp8'] else ''}) on "
             f"{doc['hardware']['name']} x tp {doc['tp']}, context {doc['context']}, acceptance {acc}")
    t = fit_table(out, title, caption="* best gamma at that batch size; speedup: decode tokens/s against gamma 0; "
                                      "TTFT: the batch's prompts prefilled together")
    for col in ("batch", "gamma", "step ms", "TPOT ms", "tokens/s", "speedup", "TTFT ms"):
        t.add_column(col, justify="right", no_wrap=True)
    for b in doc["batches"]:
        for i, g in enumerate(b["gammas"]):
            mark = " *" if g["gamma"] == b["best_gamma"] else ""
            t.add_row(str(b["batch_size"]) if i == 0 else "", f"{g['gamma']}{mark}", _ms(g["step_ms"]),
                      _ms(g["tpot_ms"]), f"{g['tokens_per_s']:,.0f}", f"{g['speedup']:.2f}x",
                      _ms(g["ttft_ms"]), end_section=i == len(b["gammas"]) - 1)
    out.print(t)
    out.print(_stops_paying(doc), highlight=False)
    # narrow: gaps of 2 columns, not 3 (padding shared between neighbours), so 8 columns of the widest
    # values (a batch of 65536's prefill) fit 80
    f = fit_table(out, "one forward each (batch 1 and the largest; verify at the largest gamma)",
                  caption="bound: the largest of bandwidth, compute, communication, launch, host; "
                          "FLOP: M, G, T, P, E = 1e6, 1e9, 1e12, 1e15, 1e18", collapse_padding=out.width < WIDE)
    for col in ("batch", "forward", "rows", "bytes", "FLOP", "kernels", "ms", "bound"):
        f.add_column(col, justify="right", no_wrap=True)  # a number and its unit on one line, never cut
    for batch, fwds in doc["steps"].items():
        for i, s in enumerate(fwds):
            f.add_row(batch if i == 0 else "", s["kind"], str(s["rows"]), _bytes(s["bytes"]),
                      _flop(s["flops"]), f"{s['kernels']:.0f}", _ms(s["ms"]), s["bound"],
                      end_section=i == len(fwds) - 1)
    out.print(f)
    m = doc["memory"]
    out.print(f"memory per GPU: weights {fmt_bytes(m['weights_per_gpu_bytes'])}, state per sequence at --budget "
              f"{m['budget']}: {fmt_bytes(m['state_per_sequence_bytes'])}, sequences per GPU "
              f"{m['sequences_per_gpu'] if m['sequences_per_gpu'] is not None else '-'} (of "
              f"{fmt_bytes(m['gpu_memory_bytes'])})", highlight=False)
    cal = doc["calibration"]
    files = plural(len(cal["fitted"].get("files", [])), "file")
    out.print(f"calibration: {cal['hardware']} fit at {cal['fitted'].get('commit')} "
              f"({files}); acceptance from {doc['acceptance']['source']}",
              highlight=False)
    for note in doc["notes"]:
        out.print(f"[yellow]{note}[/yellow]", highlight=False)
    ex = doc["exports"]
    if ex["vllm"] is None:
        out.print(ex["note"], highlight=False)
        return
    out.print(f"\nsettings for gamma {ex['gamma']}:", highlight=False)
    out.print(f"vLLM ({ex['docs']['vllm']}):\n  --speculative-config '{ex['vllm']}'", highlight=False, markup=False, soft_wrap=True)
    out.print(f"SGLang ({ex['docs']['sglang']}):\n  {ex['sglang']}", highlight=False, markup=False, soft_wrap=True)
    out.print(f"TensorRT-LLM ({ex['docs']['trtllm']}):\n{ex['trtllm']}", highlight=False, markup=False, soft_wrap=True)


def _ms(v: float) -> str:
    """Milliseconds in at most 9 characters below 1e9 ms: fewer decimals as the value grows."""
    return f"{v:.3f}" if v < 100 else f"{v:.1f}" if v < 10_000 else f"{v:,.0f}"


def _bytes(n: float) -> str:
    """fmt_bytes in at most 10 characters: whole units where two decimals would not fit (1023.50 GiB)."""
    text = fmt_bytes(n)
    return text if len(text) <= 10 else fmt_bytes(n, 0)


def _flop(n: float) -> str:
    """FLOPs in at most 6 characters (3 significant digits and M, G, T, P or E), for the 80-column table."""
    for unit, div in FLOP_UNITS:
        text = f"{n / div:.3g}"
        if float(text) < 1000:  # 999.9e6 rounds to 1e+03 M: that is 1 G
            return f"{text} {unit}"
    return f"{n / div:.0f} {unit}"


def _stops_paying(doc: dict) -> str:
    """The batch where speculation stops paying, searched only up to what fits in memory."""
    stop, limit = doc["speculation_stops_paying_at_batch"], doc["break_even_searched_up_to_batch"]
    fits = doc["memory"]["sequences_per_gpu"]
    if stop is not None:
        return f"speculation stops paying at batch {stop} (no gamma beats 0 there)"
    if limit == 0:
        return "speculation: no sequence fits on a GPU beside the weights, so no batch size is a deployment"
    if limit == fits:
        return (f"speculation does not stop paying up to the {fits} sequences that fit per GPU (at --budget "
                f"{doc['memory']['budget']})")
    return f"speculation pays at every batch up to {limit} (searched no further)"


def _calibrate(files: list[str], check: list[str], hw, out: Path | None, json_out: bool) -> None:
    from glm5mtp_cli.diagnostics import calibration as cal_mod
    from glm5mtp_cli.diagnostics import plan_fit

    check_output(out, "--out")
    measured = [m for f in files for m in cal_mod.read_measurements(Path(f))]
    cal = plan_fit.fit(measured, hw, files)
    checked = _checked(check, hw, cal)
    if out is not None:
        out.write_text(cal_mod.to_json(cal))
    _report(cal, checked, hw, json_out, fitted=True)
    if out is not None and not json_out:
        Console().print(f"written to {out}", highlight=False)


def _checked(files: list[str], hw, cal) -> list[dict]:
    """The files' measurements beside `cal`'s predictions on `hw`."""
    from glm5mtp_cli.diagnostics import calibration as cal_mod
    from glm5mtp_cli.diagnostics import plan_fit

    if not files:
        return []
    held_out = [m for f in files for m in cal_mod.read_measurements(Path(f), "--check")]
    # kernel counts are inputs (counted, like bytes), not fitted: a family the calibration counted keeps
    # its counts (its per-kernel cost was fitted with them); the files' own count the others
    counts = cal_mod.kernel_counts(held_out, plan_fit.family_of_measurement)
    return plan_fit.compare(held_out, hw, dataclasses.replace(cal, kernels={**counts, **cal.kernels}))


def _report(cal, checked: list[dict], hw, json_out: bool, fitted: bool) -> None:
    """A fit (its values and residuals) or a calibration's predictions of --check files."""
    if json_out:
        sys.stdout.write(json.dumps({"calibration": dataclasses.asdict(cal), "check": checked}) + "\n")
        return
    console = Console()
    e = cal.bandwidth_efficiency
    head = (f"fitted on {hw.name}" if fitted else f"{cal.hardware} calibration, predicting on {hw.name}")
    files = plural(len(cal.fitted.get("files", [])), "file")
    console.print(f"{head} ({files}, commit {cal.fitted.get('commit')}): bandwidth "
                  + ", ".join(f"{k} {v:.3f}" for k, v in e.items())
                  + f" of the datasheet's; per kernel {cal.per_kernel_s * 1e6:.2f} us; host "
                  f"{cal.host_step_s * 1e6:.1f} us per step, {cal.host_forward_s * 1e6:.1f} us per forward, "
                  f"{cal.host_sequence_s * 1e6:.1f} us per sequence ({cal.fitted.get('host_sequence_s')})",
                  highlight=False)
    tables = ((("the fit's own measurements", cal.residuals),) if fitted else ()) + (("held out (--check)", checked),)
    for title, rows in tables:
        if not rows:
            continue
        t = fit_table(console, title)
        t.add_column("file", justify="right", overflow="fold")  # a long name folds onto lines, not cut
        for col in ("what", "measured ms", "predicted ms", "error"):
            t.add_column(col, justify="right", no_wrap=col != "what")
        for r in rows:
            t.add_row(Path(r["source"]).name, r["what"], f"{r['measured_ms']:.3f}", f"{r['predicted_ms']:.3f}",
                      f"{r['error']:+.1%}")
        console.print(t)


def _plot(path: Path, doc: dict) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    sizes = [b["batch_size"] for b in doc["batches"]]
    for i, g in enumerate(doc["batches"][0]["gammas"]):
        ax.plot(sizes, [b["gammas"][i]["tokens_per_s"] for b in doc["batches"]], marker="o", label=f"gamma {g['gamma']}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens/s")
    acc = ",".join(f"{p:.2g}" for p in doc["acceptance"]["conditional"])
    ax.set_title(f"{doc['model']} on {doc['hardware']['name']} x tp {doc['tp']}, acceptance {acc}", fontsize="small")
    ax.legend(fontsize="small")
    save(fig, path)
