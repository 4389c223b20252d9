"""`glm5mtp bench`: side by side on one device: transformers, gamma 0, gamma 1..4; batch 1 and 8.

Parse and print only: the runs and the step timings are diagnostics.bench's."""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console

from glm5mtp_cli.commands.options import (DEFAULT_MODEL, MODEL, CompileModeOpt, CompileOpt, ConstrainAfterOpt,
                                          CudaGraphsOpt, DeviceOpt, DraftMaskOpt, DtypeOpt, Fp8Opt, GrammarOpt,
                                          JsonObjectOpt, JsonOpt, JsonSchemaOpt, LayersOpt, ModelOpt, PrefillGraphsOpt,
                                          PrefillTokensOpt, RegexOpt, ScheduleOpt, SyntheticOpt, synthetic_rates,
                                          ThreadsOpt, TpOpt, constraint_flags)
from glm5mtp_cli.engine.config import MAX_GAMMA, EngineConfig, ModelSpec
from glm5mtp_cli.errors import UserError

if TYPE_CHECKING:  # the engine's modules import torch: not for --help
    from glm5mtp_cli.diagnostics.bench import BenchConfig
from glm5mtp_cli.prompts import encode_prompts, read_file

# bench's own help panels (options.py holds the shared ones)
BASELINE = "Baseline"
STEPS = "Single steps"


def _ints(text: str, flag: str, low: int, high: int | None = None) -> list[int]:
    """Bounded here, not by the engine's config, so that a refusal names this list's flag (--gammas, not --gamma)."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < low:
        raise UserError(f"{flag}: values must be >= {low}, got {text!r}")
    if high is not None and max(vals) > high:
        raise UserError(f"{flag}: values must be <= {high}, got {text!r}")
    return vals


def _prompts(rt, items, need: int) -> tuple[list[list[int]], list]:
    """--prompts (any form of prompts.py), else the default set (acceptance's too), repeated to `need`;
    beside them each one's constraint (its line's response_format, or None)."""
    from glm5mtp_cli.diagnostics.acceptance import default_prompt_set

    if items is not None:
        ids = encode_prompts(items, rt.tokenizer, folder=rt.resolved.folder)
        rules = [p.constraint for p in items]
    else:
        ids = default_prompt_set(rt, need).token_lists
        rules = [None] * len(ids)
    while len(ids) < need:
        ids, rules = ids + ids, rules + rules
    return ids[:need], rules[:need]


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def _wall(row: dict) -> tuple[str, str]:
    """The run's wall time in admissions and in all (transformers' rows have no such split)."""
    p, d = row.get("wall_prefill_s"), row.get("wall_decode_s")
    return ("-", "-") if p is None or d is None else (f"{p:.2f}", f"{p + d:.2f}")


def _capture(row: dict) -> str:
    """Seconds spent building and capturing graphs (none for transformers' rows or eager runs)."""
    ms = row.get("graph_capture_ms")
    return "-" if not ms else f"{ms / 1e3:.2f}"


def _seqs(step: dict) -> str:
    return f"{step['batch']} sequences x " if step["batch"] > 1 else ""


def _floor(step: dict) -> str:
    if step["floor_ms"] is None:
        return "no floor on the CPU"
    return f"floor {step['floor_ms']:.3f} ms ({step['ratio_to_floor']:.2f}x)"


def _print_kernels(out, what: str, step: dict) -> None:
    from glm5mtp_cli.diagnostics.report import fit_table

    k = step["kernels"]
    t = fit_table(out, f"{what}: {k['source']}, {k['total_ms_per_step']:.3f} ms per step in {k['calls_per_step']:.0f} "
                       f"calls of {k['kinds']} kinds (step {step['step_ms']:.3f} ms)",
                  caption=f"top {len(k['top'])} by time per step, over {k['steps']} profiled steps")
    t.add_column("kernel", overflow="fold")  # a CUDA kernel's name is one long word: folded onto lines, not cut
    for col in ("calls", "ms", "share"):
        t.add_column(col, justify="right")
    for r in k["top"]:
        t.add_row(r["name"][:90], f"{r['calls_per_step']:.0f}", f"{r['ms_per_step']:.4f}", f"{r['share']:.1%}")
    out.print(t)


def _print_recommendations(out, recs: list[dict]) -> None:
    """diagnostics/recommend.py's per batch size: the gamma the table measured fastest (decode only),
    then the model's pick where it differs: a gamma that measured slower, or one not run (to measure)."""
    if not recs:
        out.print("no gamma recommendation: it needs gamma 0 and a fixed gamma > 0 at one batch size")
        return
    for r in recs:
        best, batch, model = r["best_gamma"], r["batch"], r["model_best_gamma"]
        out.print(f"recommended gamma {best} at batch {batch}: measured {r['measured_tokens_per_s']:.1f} decode "
                  f"tokens/s, the fastest run (the model predicts {r['predicted_tokens_per_s']:.1f})", highlight=False)
        if model == best:
            continue
        pred, m = r["model_best_tokens_per_s"], r["model_best_measured_tokens_per_s"]
        if m is not None:
            out.print(f"  the model's pick was gamma {model} (predicted {pred:.1f}), but it measured {m:.1f}: the "
                      "measurement decides", highlight=False)
        else:
            out.print(f"  the model predicts gamma {model}, not run at batch {batch}, at {pred:.1f}: extrapolated, "
                      f"not measured; measure it with --gammas {model} --batch-sizes {batch}", highlight=False)
    out.print("[dim]the model: decode tokens/s (prefill excluded) = slots x (1 + p_1 + ... + p_g) / (verify + g x "
              "draft), the cost line fitted to the measured steps; p_k: the largest gamma's per-position "
              "acceptance[/dim]")


def _table(out, title: str, caption: str, headers: tuple[str, ...], cells, rows: list[dict]):
    """One of print_rows' tables: a row per bench row, a rule between batch sizes."""
    from glm5mtp_cli.diagnostics.report import WIDE, fit_table

    # narrow: gaps of 2 columns, not 3 (padding shared between neighbours), so the names fit beside the numbers
    t = fit_table(out, title, caption=caption, collapse_padding=out.width < WIDE)
    for h in headers:
        t.add_column(h, justify="left" if h == "system" else "right")
    for i, r in enumerate(rows):
        t.add_row(*cells(r), end_section=i + 1 < len(rows) and rows[i + 1]["batch"] != r["batch"])
    return t


def print_rows(out, doc: dict) -> None:
    """bench's rows as three tables that fit 80 columns (tokens/s, latency, wall time), the adaptive rows'
    gamma mix and the recommendation. Two-line headers keep the columns narrow."""
    rows = doc["rows"]
    if doc.get("synthetic_acceptance"):
        out.print(f"[yellow]synthetic acceptance[/yellow] {','.join(f'{p:g}' for p in doc['synthetic_acceptance'])}: "
                  "every gamma > 0 row keeps drafts as drawn, not as the target decides (its tokens are not the "
                  "target's); the speeds and the recommendation hold at that acceptance", highlight=False)
    out.print(_table(
        out, f"bench on {doc['device']} ({doc['dtype']}), {doc['max_new_tokens']} new tokens, medians of "
             f"{doc['repeats']}: tokens/s",
        "e2e: end to end; pred. decode: the row's decode tok/s predicted from the other gammas' runs alone "
        "(held out: their step cost line and acceptance; '-' with fewer than 3 gammas, where a fit through the "
        "others would only echo it); acc len: mean acceptance length; vs gamma 0, vs HF: e2e speedup against "
        "gamma 0 and transformers' generate",
        ("batch", "prompts", "system", "e2e\ntok/s", "decode\ntok/s", "pred.\ndecode", "acc\nlen", "vs\ngamma 0",
         "vs\nHF"),
        lambda r: (str(r["batch"]), str(r["prompts"]), r["system"], _fmt(r["e2e_tokens_per_s"], ".1f"),
                   _fmt(r["decode_tokens_per_s"], ".1f"), _fmt(r.get("predicted_decode_tokens_per_s"), ".1f"),
                   _fmt(r["mean_acceptance_length"], ".2f"), _fmt(r["speedup_vs_gamma0"], ".2f"),
                   _fmt(r["speedup_vs_transformers"], ".2f")),
        rows))
    out.print(_table(
        out, "latency, ms", "TTFT (queue + prefill) and TPOT: percentiles over the median run's requests",
        ("batch", "system", "TTFT\np50", "TTFT\np99", "TPOT\np50", "TPOT\np99"),
        lambda r: (str(r["batch"]), r["system"], _fmt(r["ttft_ms_p50"], ".1f"), _fmt(r["ttft_ms_p99"], ".1f"),
                   _fmt(r["tpot_ms_p50"], ".2f"), _fmt(r["tpot_ms_p99"], ".2f")),
        rows))
    out.print(_table(
        out, "wall time, s", "prefill: the run's admissions; run: all of it; capture: building and capturing the "
                             "engine's CUDA graphs (--prefill-graphs buckets too), apart from e2e",
        ("batch", "system", "prefill", "run", "capture"),
        lambda r: (str(r["batch"]), r["system"], *_wall(r), _capture(r)),
        rows))
    if any(r.get("constrained") for r in rows):
        out.print(_table(
            out, "constrained requests", "of the first timed run: complete (the grammar accepted the output's "
                                         "end), valid (checked by a fresh matcher; every complete output must be)",
            ("batch", "system", "constrained", "complete", "valid"),
            lambda r: (str(r["batch"]), r["system"], *(str(r.get(k, "-")) for k in ("constrained", "complete", "valid"))),
            [r for r in rows if r.get("constrained") is not None]))
    for r in rows:
        if r["gamma"] and r.get("gamma_policy") == "adaptive" and r.get("gamma_steps"):
            mix = ", ".join(f"{n} at gamma {g}" for g, n in r["gamma_steps"].items())
            out.print(f"[dim]{r['system']} at batch {r['batch']} (first timed run): steps {mix}[/dim]")
    _print_recommendations(out, doc["recommendation"])


def bench_cmd(
    model: ModelOpt = DEFAULT_MODEL,
    prompts: Annotated[Optional[Path], typer.Option("--prompts", metavar="FILE",
        help="JSONL prompts, as for generate (default: the shipped model's code prompts).")] = None,
    num_prompts: Annotated[Optional[int], typer.Option("--num-prompts", metavar="N",
        help="Run N prompts (the file's first N, repeated if short) through each batch size's slots, end to end "
             "(default: one prompt per slot).")] = None,
    gammas: Annotated[str, typer.Option("--gammas", metavar="LIST",
                                        help="Comma-separated gammas; 0 is the baseline.")] = "0,1,2,3,4",
    batch_sizes: Annotated[str, typer.Option("--batch-sizes", metavar="LIST",
                                             help="Comma-separated batch sizes.")] = "1,8",
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", metavar="N",
                                                help="Tokens to generate per request (at least 2).")] = 128,
    repeats: Annotated[int, typer.Option("--repeats", metavar="N",
                                         help="Timed runs per configuration (after one warm-up).")] = 3,
    transformers: Annotated[bool, typer.Option("--transformers/--no-transformers", metavar="", rich_help_panel=BASELINE,
                                               help="Also time transformers' generate (target only).")] = True,
    draft_context: Annotated[int, typer.Option("--draft-context", metavar="N", rich_help_panel=STEPS,
                                               help="Drafter rows behind the timed single draft step.")] = 4096,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    layers: LayersOpt = None,
    json_out: JsonOpt = False,
    random_weights: Annotated[bool, typer.Option("--random-weights", metavar="", rich_help_panel=MODEL,
        help="Draft step and one target decode step only, with random weights of the model's config built on the "
             "device (e.g. --model glm5, --model glm5next); with --tp N each rank builds and times its own "
             "shard.")] = False,
    fp8: Fp8Opt = False,
    draft_vocab_sizes: Annotated[str, typer.Option("--draft-vocab-sizes", metavar="LIST", rich_help_panel=STEPS,
                                                   help="Draft-step vocabularies to time; 0 is the full "
                                                        "vocabulary.")] = "0",
    step_batch_sizes: Annotated[str, typer.Option("--step-batch-sizes", metavar="LIST", rich_help_panel=STEPS,
        help="Sequences per timed draft and target step, each at --draft-context rows (steps at batch > 1 "
             "calibrate plan's per-sequence costs).")] = "1",
    draft_vocab_file: Annotated[Optional[Path], typer.Option("--draft-vocab-file", metavar="FILE", rich_help_panel=STEPS,
        help="Token counts for --draft-vocab-sizes (default: token_counts.json beside the checkpoint).")] = None,
    target_layers: Annotated[Optional[int], typer.Option("--target-layers", metavar="N", rich_help_panel=STEPS,
        help="With --random-weights: also time one decode step of the target truncated to its first N layers, "
             "which must hold every kind of layer (default: 4, or all of a smaller model; 0: skip).")] = None,
    kernels: Annotated[bool, typer.Option("--kernels", metavar="", rich_help_panel=STEPS,
                                          help="Also profile the draft (and target) step: the top kernels by time "
                                               "per step and their share (torch.profiler).")] = False,
    cuda_graphs: CudaGraphsOpt = True,
    compile: CompileOpt = None,
    compile_mode: CompileModeOpt = "default",
    schedule: ScheduleOpt = "continuous",
    gamma_policy: Annotated[str, typer.Option("--gamma-policy", metavar="LIST",
        help="fixed, adaptive, or fixed,adaptive: each gamma > 0 runs under each, in turns with the "
             "others.")] = "fixed",
    prefill_tokens: PrefillTokensOpt = 8192,
    prefill_graphs: PrefillGraphsOpt = False,
    tp: TpOpt = 1,
    threads: ThreadsOpt = None,
    synthetic_acceptance: SyntheticOpt = None,
    json_schema: JsonSchemaOpt = None,
    json_object: JsonObjectOpt = False,
    regex: RegexOpt = None,
    grammar: GrammarOpt = None,
    constrain_after: ConstrainAfterOpt = None,
    draft_mask: DraftMaskOpt = True,
) -> None:
    """Tokens/s, TPOT and speedups of speculation against gamma 0 and transformers; draft step vs its floor.

    Examples:

      glm5mtp bench --gammas 0,3 --batch-sizes 1 --max-new-tokens 64

      glm5mtp bench --prompts humaneval.jsonl --num-prompts 164 \\
          --batch-sizes 1,8,32,64 --gammas 0,3 --gamma-policy fixed,adaptive

      glm5mtp bench --model glm5 --random-weights --device cuda \\
          --draft-vocab-sizes 0,32768 --json

      # GLM-5-FP8's draft step, per kernel
      glm5mtp bench --model glm5 --random-weights --fp8 --device cuda --kernels

      glm5mtp bench --model glm5next --random-weights --device cuda \\
          --draft-context 2048 --target-layers 4

      # per GPU at tp 8: rank 0's steps
      glm5mtp bench --model glm5 --random-weights --fp8 --tp 8 --device cuda

      glm5mtp bench --model glm5-nano --random-weights --device cuda \\
          --draft-context 512 --compile kernels
    """
    from glm5mtp_cli.diagnostics.bench import BenchConfig

    if draft_context < 1:
        raise UserError("--max-new-tokens must be >= 2, --repeats and --draft-context >= 1")
    spec = ModelSpec(model, device, dtype, layers, random_weights=random_weights, fp8=fp8, tp=tp)
    engine = EngineConfig(max_new_tokens=max_new_tokens, schedule=schedule, prefill_tokens=prefill_tokens,
                          prefill_graphs=prefill_graphs, graphs="auto" if cuda_graphs else "off", compile=compile,
                          compile_mode=compile_mode, eos_ids=(),
                          synthetic_acceptance=synthetic_rates(synthetic_acceptance))
    policies = tuple(dict.fromkeys(p.strip() for p in gamma_policy.split(",")))
    c = BenchConfig(engine, tuple(_ints(gammas, "--gammas", 0, MAX_GAMMA)), tuple(_ints(batch_sizes, "--batch-sizes", 1)), repeats,
                    transformers, gamma_policies=policies, num_prompts=num_prompts)
    sizes = _ints(draft_vocab_sizes, "--draft-vocab-sizes", 0)
    step_batches = tuple(_ints(step_batch_sizes, "--step-batch-sizes", 1))
    if tp > 1 and any(sizes):
        # a draft vocabulary is a subset of the whole head's rows; under --tp each rank holds a slice
        raise UserError("--draft-vocab-sizes under --tp: only 0 (the full vocabulary) is timed over split ranks")
    if target_layers is not None and target_layers < 0:
        raise UserError(f"--target-layers must be >= 0, got {target_layers}")
    if draft_vocab_file is not None and not draft_vocab_file.is_file():
        raise UserError(f"--draft-vocab-file {draft_vocab_file}: no such file")
    items = read_file(prompts) if prompts is not None else None
    from glm5mtp_cli.checkpoint.resolve import local_folder, resolve_config

    c = dataclasses.replace(c, engine=engine.replace(**constraint_flags(
        json_schema, json_object, regex, grammar, constrain_after, draft_mask, items, local_folder(model),
        resolve_config(model)[0].vocab_size, synthetic_acceptance is not None, tp)))
    run = BenchRun(spec, c, items, draft_context, tuple(sizes), step_batches, draft_vocab_file, target_layers, kernels,
                   json_out)
    from glm5mtp_cli.engine import launch
    from glm5mtp_cli.engine.runtime import set_threads

    set_threads(threads)
    launch.run(spec, run_bench_command, run)


@dataclass(frozen=True)
class BenchRun:
    """Everything `bench` decided from its flags: what each rank runs (run_bench_command)."""

    model: ModelSpec
    bench: BenchConfig
    items: list | None  # prompts (--prompts), None: the shipped model's
    draft_context: int
    draft_vocab_sizes: tuple[int, ...]
    step_batch_sizes: tuple[int, ...]
    draft_vocab_file: Path | None
    target_layers: int | None
    kernels: bool
    json_out: bool


def run_bench_command(run: BenchRun) -> None:
    import torch

    from glm5mtp_cli.checkpoint.resolve import resolve_config
    from glm5mtp_cli.diagnostics.bench import add_ratios, run_glm5mtp, run_transformers, systems_of
    from glm5mtp_cli.diagnostics.recommend import recommend
    from glm5mtp_cli.diagnostics.step_bench import (StepTiming, check_target_layers, copy_bandwidth, draft_step,
                                                    random_drafter, target_step)
    from glm5mtp_cli.engine import launch
    from glm5mtp_cli.engine.compiled import default_compile
    from glm5mtp_cli.engine.runtime import before_loading, load_runtime, pick_dtype, rank_device, resolve
    from glm5mtp_cli.models.fp8 import fp8_config

    spec, c, json_out = run.model, run.bench, run.json_out
    model, target_layers, draft_context, kernels = spec.name, run.target_layers, run.draft_context, run.kernels
    cuda_graphs, compile_mode = c.engine.graphs == "auto", c.engine.compile_mode
    max_new_tokens, repeats = c.engine.max_new_tokens, c.repeats
    comm = launch.rank_comm(spec.tp, spec.device)
    world = comm.world if comm is not None else 1
    if comm is not None:
        c = dataclasses.replace(c, with_transformers=False)  # transformers' generate runs on one device: not a tp baseline
    out = Console(stderr=json_out)
    rows = []
    if spec.random_weights:
        dev = rank_device(spec.device, comm)
        dt = pick_dtype(spec.dtype, dev)
        cfg, _ = resolve_config(model)
        if spec.fp8:
            cfg = fp8_config(cfg)
        if target_layers is None:
            target_layers = min(4, cfg.num_hidden_layers)
        if target_layers:
            check_target_layers(cfg, target_layers)
        # the drafter and the truncated target are held one after the other: checking both together over-counts
        before_loading(model, cfg.with_layers(target_layers or 1), dt, dev, with_mtp=True, comm=comm)
        # under --tp: this rank's shard, split by the rules the runtime loads with; every rank times
        # the same steps in lockstep (the collectives inside the forwards) and rank 0 reports
        mtp, embed, head = random_drafter(cfg, dev, dt, comm=comm)
        folder = None
        # how the steps are timed: graph replays where the family's forwards can be captured
        c = dataclasses.replace(c, engine=c.engine.replace(
            graphs="cuda" if cuda_graphs and dev.type == "cuda" else "eager",
            compile=c.engine.compile or default_compile(cfg)))
    else:
        rt = load_runtime(spec, progress=not json_out, comm=comm)
        c = dataclasses.replace(c, engine=resolve(rt, c.engine))
        cfg, dev, dt, folder = rt.cfg, rt.device, rt.dtype, rt.resolved.folder
        mtp, embed, head = rt.mtp, rt.target.embed_tokens, rt.target.lm_head
        ids, rules = _prompts(rt, run.items, max(list(c.batch_sizes) + [c.num_prompts or 0]))
    for batch in ([] if spec.random_weights else c.batch_sizes):
        if c.with_transformers:
            out.print(f"[dim]transformers generate, batch {batch}[/dim]")
            rows.append(run_transformers(rt, ids, batch, c))
        systems = systems_of(c)
        names = ", ".join(f"gamma {g}" + (f" {p}" if g else "") for g, p in systems)
        out.print(f"[dim]glm5mtp, batch {batch}: {names}" + (", in turns" if len(systems) > 1 else "") + "[/dim]")
        rows += run_glm5mtp(rt, ids, systems, batch, c, rules)
    add_ratios(rows)
    recs = recommend(rows)
    timing = StepTiming(dev, dt, draft_context, graphs=cuda_graphs, kernels=kernels,
                        compile=(c.engine.compile, compile_mode), tp=world, bandwidth=copy_bandwidth(dev))
    batched = [dataclasses.replace(timing, batch=b) for b in run.step_batch_sizes]
    drafts = [draft_step((mtp, embed, head), bt, k, folder, run.draft_vocab_file)
              for k in run.draft_vocab_sizes for bt in batched]
    t_steps = []
    if spec.random_weights and target_layers:
        del mtp, embed, head
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        t_steps = [target_step(cfg, target_layers, bt, comm) for bt in batched]
    doc = {"model": model, "device": str(dev), "tp": world, "graphs": c.engine.graphs,
           "compile": c.engine.compile, "compile_mode": compile_mode,
           "target_step": t_steps[0] if t_steps else None,
           "target_steps": t_steps,
           "dtype": str(dt).replace("torch.", ""), "random_weights": spec.random_weights,
           "fp8_weights": bool(getattr(cfg, "fp8", False)),
           "max_new_tokens": max_new_tokens, "repeats": repeats, "rows": rows, "recommendation": recs,
           "synthetic_acceptance": c.engine.synthetic_acceptance,
           "draft_step": drafts[0],
           "draft_steps": drafts}
    if json_out:
        sys.stdout.write(json.dumps(doc) + "\n")
        return
    if rows:
        print_rows(out, doc)
    rank = f" on rank 0 of {world}, its shard's bytes" if world > 1 else ""
    for d in drafts:
        out.print(f"one draft step ({d['timing']}{rank}), vocab {d['draft_vocab'] or cfg.vocab_size}, {_seqs(d)}"
                  f"{draft_context} drafter rows: {d['step_ms']:.3f} ms, reads {d['bytes']['total'] / 1e9:.4f} GB; "
                  f"{_floor(d)}")
        if d["kernels"]:
            _print_kernels(out, f"draft step, vocab {d['draft_vocab'] or cfg.vocab_size}, batch {d['batch']}", d)
    for t in t_steps:
        out.print(f"one target decode step ({t['timing']}{rank}), {t['layers']} layers, {_seqs(t)}{draft_context} "
                  f"cached rows: {t['step_ms']:.3f} ms, reads {t['bytes']['total'] / 1e9:.4f} GB; {_floor(t)}")
        if t["kernels"]:
            _print_kernels(out, f"target step, {t['layers']} layers, batch {t['batch']}", t)
    out.print("[dim]--json prints these numbers as one JSON document[/dim]")
