"""`glm5mtp generate`: speculative generation with acceptance, latency and memory tables.

Parse and print only: every flag and output path is checked before any weights load; the engine
run is engine.run.run_generate; the tables are diagnostics.report's. torch is imported when the
command runs, not when its --help is built.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from glm5mtp_cli.cli import output_complete
from glm5mtp_cli.commands.options import (BATCHING, CONVERSATION, DEFAULT_MODEL, MODEL, OUTPUT, SAMPLING, SPECULATION,
                                          CompileModeOpt, CompileOpt, ConstrainAfterOpt, CudaGraphsOpt, DeviceOpt,
                                          DraftMaskOpt, DtypeOpt, Fp8Opt, GammaPolicyOpt, GrammarOpt, JsonObjectOpt,
                                          JsonOpt, JsonSchemaOpt, LayersOpt, ModelOpt, MtpIndexShareOpt,
                                          PrefillGraphsOpt, PrefillTokensOpt, PromptIdsOpt, PromptOpt, RandomWeightsOpt,
                                          RegexOpt, ScheduleOpt, SyntheticOpt, ThreadsOpt, TpOpt, constraint_flags,
                                          synthetic_rates)
from glm5mtp_cli.engine.config import EngineConfig, ModelSpec, SamplingParams
from glm5mtp_cli.errors import Interrupted, UserError
from glm5mtp_cli.output_file import check_output
from glm5mtp_cli.prompts import read_prompts
from glm5mtp_cli.units import parse_size

EXAMPLES = """

Examples:

  glm5mtp generate --prompt 'class Point:' --temperature 0.5 --top-p 0.9

  glm5mtp generate --prompts prompts.jsonl --batch-size 4 --json > out.json

  glm5mtp generate --prompt-ids 3,17,99 --gamma 4 --compare --trace steps.jsonl

  glm5mtp generate --conversation chats.jsonl --carry all

  glm5mtp generate --prompt 'point = ' --json-schema point.schema.json --compare
"""

# What --conversation does with each generate flag (also in the README): honoured, or refused.
CONVERSATION_REFUSES = {
    "batch_size": "--batch-size: --conversation runs one turn at a time (each turn's prompt needs the previous reply)",
    "compare": "--compare: --conversation compares against running without carried caches instead "
               "(same_tokens_as_no_carry); run the turns with --gamma 0 for the baseline",
    "prefill_graphs": "--prefill-graphs: --conversation prefills one turn at a time; the graphs are for prompt sets",
    "constraint": "constraints: --conversation does not constrain replies; constrain single prompts (--prompts "
                  "lines may carry their own response_format)",
}


def generate_cmd(
    prompt: PromptOpt = None,
    model: ModelOpt = DEFAULT_MODEL,
    prompt_ids: PromptIdsOpt = None,
    prompts: Annotated[Optional[Path], typer.Option("--prompts",
        metavar="FILE", help='JSONL, one per line: {"prompt": "text"}, {"prompt": \\[token ids]} or '
                             '{"messages": [...]}, any with a "response_format" (constraints).')] = None,
    chat: Annotated[bool, typer.Option("--chat", metavar="", help="Wrap text prompts in the checkpoint's chat template.")] = False,
    gamma: Annotated[int, typer.Option("--gamma", metavar="N", rich_help_panel=SPECULATION,
                                       help="Drafts per verify step (0: no speculation; the most with "
                                            "--gamma-policy adaptive).")] = 3,
    gamma_policy: GammaPolicyOpt = "fixed",
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", metavar="N", rich_help_panel=SAMPLING,
                                                help="Tokens to generate per request.")] = 64,
    temperature: Annotated[float, typer.Option("--temperature", metavar="T", rich_help_panel=SAMPLING,
                                               help="Sampling temperature; 0 is greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", metavar="P", rich_help_panel=SAMPLING,
                                         help="Nucleus sampling: keep the smallest set of tokens whose probabilities "
                                              "reach this (1: all; used with --temperature > 0).")] = 1.0,
    seed: Annotated[int, typer.Option("--seed", metavar="N", rich_help_panel=SAMPLING,
                                      help="Seed of the sampler (same seed, same output).")] = 0,
    draft_conf_tau: Annotated[Optional[float], typer.Option("--draft-conf-tau", metavar="P", rich_help_panel=SPECULATION,
        help="Stop a draft chain below this top-1 probability (default: never).")] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", metavar="N", rich_help_panel=BATCHING,
                                            help="Requests decoded together (slots).")] = 1,
    schedule: ScheduleOpt = "continuous",
    prefill_tokens: PrefillTokensOpt = 8192,
    prefill_graphs: PrefillGraphsOpt = False,
    max_seq_len: Annotated[Optional[int], typer.Option("--max-seq-len", metavar="N", rich_help_panel=BATCHING,
        help="Ceiling on prompt + new tokens (default: the model's max_position_embeddings).")] = None,
    alloc: Annotated[str, typer.Option("--alloc", metavar="NAME", rich_help_panel=BATCHING,
                                       help="budget: size state to each request; ceiling: to --max-seq-len.")] = "budget",
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    layers: LayersOpt = None,
    revision: Annotated[Optional[str], typer.Option("--revision", metavar="REV", rich_help_panel=MODEL,
                                                    help="Hub revision (branch, tag or commit).")] = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", metavar="", rich_help_panel=SAMPLING,
                                             help="Generate --max-new-tokens whatever the model says.")] = False,
    compare: Annotated[bool, typer.Option("--compare", metavar="", rich_help_panel=OUTPUT,
                                          help="Also run gamma 0 on the same engine; report the speedup and whether "
                                               "the tokens matched.")] = False,
    json_out: JsonOpt = False,
    trace: Annotated[Optional[Path], typer.Option("--trace", metavar="FILE", rich_help_panel=OUTPUT,
                                                  help="Write JSON lines, one per verify step per request.")] = None,
    tp: TpOpt = 1,
    conversation: Annotated[Optional[Path], typer.Option("--conversation", metavar="FILE", rich_help_panel=CONVERSATION,
        help='JSONL: {"turns": ["...", ...]} per line (text or token id lists); each reply is appended before the '
             'next turn. Honours every flag except --batch-size and --compare, which it refuses.')] = None,
    carry: Annotated[str, typer.Option("--carry", metavar="NAME", rich_help_panel=CONVERSATION,
                                       help="Caches kept between turns: all (target + drafter), drafter, "
                                            "none.")] = "none",
    carry_budget: Annotated[Optional[str], typer.Option("--carry-budget", metavar="BYTES", rich_help_panel=CONVERSATION,
        help="Bytes of held carries, e.g. 512MiB, 2GB; least recently used are freed past it (default: no "
             "limit).")] = None,
    draft_vocab: Annotated[Optional[int], typer.Option("--draft-vocab", metavar="K", rich_help_panel=SPECULATION,
        help="Draft over the K most frequent tokens (counts: token_counts.json beside the checkpoint, or "
             "--draft-vocab-file).")] = None,
    draft_vocab_file: Annotated[Optional[Path], typer.Option("--draft-vocab-file", metavar="FILE",
        rich_help_panel=SPECULATION,
        help="Token counts written by `glm5mtp draft-vocab --out FILE`, for --draft-vocab.")] = None,
    cuda_graphs: CudaGraphsOpt = True,
    compile: CompileOpt = None,
    compile_mode: CompileModeOpt = "default",
    random_weights: RandomWeightsOpt = False,
    fp8: Fp8Opt = False,
    threads: ThreadsOpt = None,
    mtp_index_share: MtpIndexShareOpt = None,
    synthetic_acceptance: SyntheticOpt = None,
    json_schema: JsonSchemaOpt = None,
    json_object: JsonObjectOpt = False,
    regex: RegexOpt = None,
    grammar: GrammarOpt = None,
    constrain_after: ConstrainAfterOpt = None,
    draft_mask: DraftMaskOpt = True,
) -> None:
    """Speculative generation: the MTP head drafts, the target verifies; output equals the target's."""
    check_output(trace, "--trace")
    if carry_budget is not None:  # units as every byte flag takes them (512MiB, 2GB)
        carry_budget = parse_size(carry_budget, "--carry-budget", zero_ok=True)
    spec = ModelSpec(model, device, dtype, layers, revision, random_weights, fp8, tp, mtp_index_share)
    engine = EngineConfig(
        gamma=gamma, gamma_policy=gamma_policy, max_new_tokens=max_new_tokens, batch_size=batch_size,
        sampling=SamplingParams(temperature, top_p, seed), draft_conf_tau=draft_conf_tau, draft_vocab=draft_vocab,
        draft_vocab_file=str(draft_vocab_file) if draft_vocab_file is not None else None, max_seq_len=max_seq_len,
        alloc=alloc, schedule=schedule, prefill_tokens=prefill_tokens, prefill_graphs=prefill_graphs,
        graphs="auto" if cuda_graphs else "off", compile=compile, compile_mode=compile_mode,
        eos_ids=() if ignore_eos else None, synthetic_acceptance=synthetic_rates(synthetic_acceptance))
    convs = items = None
    if conversation is not None:
        if any(x is not None for x in (prompt, prompt_ids, prompts)):
            raise UserError("--conversation replaces --prompt, --prompt-ids and --prompts: give one of them")
        constrained = any(x is not None for x in (json_schema, regex, grammar, constrain_after)) or json_object
        for flag, given in (("batch_size", batch_size != 1), ("compare", compare), ("prefill_graphs", prefill_graphs),
                            ("constraint", constrained)):
            if given:
                raise UserError(f"{CONVERSATION_REFUSES[flag]}")
        from glm5mtp_cli.engine.conversation import check_carry_flags, read_conversations

        check_carry_flags(carry, carry_budget)
        convs = read_conversations(conversation)
    else:
        if carry != "none" or carry_budget is not None:
            raise UserError(f"{'--carry' if carry != 'none' else '--carry-budget'} needs --conversation")
        items = read_prompts(prompt, prompt_ids, prompts, others=", --conversation")
    if compare and synthetic_acceptance is not None:
        raise UserError("--compare checks that speculation gives the target's tokens; --synthetic-acceptance "
                        "does not (its acceptance is drawn, not decided by the target)")
    if compare and gamma == 0:
        raise UserError("--compare runs gamma 0 beside --gamma: give --gamma >= 1 to have something to compare")
    from glm5mtp_cli.engine import launch
    from glm5mtp_cli.engine.runtime import set_threads

    set_threads(threads)
    cfg, folder = _refuse_before_loading(spec, engine, items)
    engine = engine.replace(**constraint_flags(json_schema, json_object, regex, grammar, constrain_after, draft_mask,
                                               items, folder, cfg.vocab_size, synthetic_acceptance is not None, tp))
    run = GenerateRun(spec, engine, items, convs, chat, compare, json_out, trace, carry, carry_budget)
    launch.run(spec, run_generate_command, run)


@dataclass(frozen=True)
class GenerateRun:
    """Everything `generate` decided from its flags: what each rank runs (run_generate_command)."""

    model: ModelSpec
    engine: EngineConfig
    items: list | None  # prompts (prompts.read_prompts), or None with conversations
    conversations: list | None  # turns per chat (--conversation)
    chat: bool
    compare: bool
    json_out: bool
    trace: Path | None
    carry: str
    carry_budget: int | None


def run_generate_command(run: GenerateRun) -> None:
    from glm5mtp_cli.engine import launch
    from glm5mtp_cli.engine.runtime import load_runtime

    out = Console(stderr=run.json_out)
    rt = load_runtime(run.model, with_mtp=run.engine.drafts or run.compare, progress=not run.json_out,
                      comm=launch.rank_comm(run.model.tp, run.model.device))
    if run.conversations is not None:
        _conversation(rt, out, run)
        return
    _single(rt, out, run)


generate_cmd.__doc__ += EXAMPLES


def _refuse_before_loading(spec: ModelSpec, engine: EngineConfig, items: list | None):
    """What the model's config alone refutes, checked before any weights load: --max-seq-len over
    the model's limit, prompt ids outside its vocabulary, --draft-vocab without counts to read.
    Returns (the model's config, its local folder or None)."""
    from glm5mtp_cli.checkpoint.resolve import local_folder, resolve_config

    cfg = resolve_config(spec.name, spec.revision)[0]
    limit, asked = cfg.max_position_embeddings, engine.max_seq_len
    if asked is not None and asked > limit:
        raise UserError(f"--max-seq-len {asked} is over the model's limit (max_position_embeddings {limit})")
    for p in items or []:
        bad = [t for t in p.ids or [] if not 0 <= t < cfg.vocab_size]
        if bad:
            raise UserError(f"{p.where}: token id {bad[0]} outside the vocabulary (0..{cfg.vocab_size - 1})")
    folder = local_folder(spec.name)
    if engine.draft_vocab is not None and folder is not None:  # a Hub id's counts are found once it is fetched
        from glm5mtp_cli.engine.draft_vocab import find_counts

        find_counts(folder, engine.draft_vocab, cfg.vocab_size, engine.draft_vocab_file)
    return cfg, folder


def _single(rt, out: Console, run: GenerateRun) -> None:
    from glm5mtp_cli.diagnostics.report import compare_block, print_tables
    from glm5mtp_cli.engine.run import Stopped, check_fits, peak_memory, run_generate
    from glm5mtp_cli.engine.runtime import resolve
    from glm5mtp_cli.prompts import encode_prompts

    config = resolve(rt, run.engine)
    token_lists = encode_prompts(run.items, rt.tokenizer, run.chat, rt.resolved.folder)
    constraints = [p.constraint for p in run.items]
    check_fits(token_lists, config, config.max_seq_len, run.engine.limit_name())
    stream = None
    if rt.tokenizer is not None and not run.json_out and len(token_lists) == 1:
        _header(out, run.model.name, rt, config)
        stream = _Streamer(rt, out, token_lists[0])
    if config.compile != "off" and not run.json_out:
        # the first step waits for it: say so rather than look hung (CPU: a minute or more)
        Console(stderr=True).print(f"[dim]--compile {config.compile}: compiling the engine's forwards before the first "
                                   "step (once per engine)[/dim]")
    try:
        with _progress(len(token_lists) * config.max_new_tokens, enabled=stream is None) as count:
            results, acc, lat, per_seq, pool_bytes = run_generate(rt, token_lists, config, on_tokens=stream or count,
                                                                  constraints=constraints)
    except Stopped as stop:
        if stream is not None:
            stream.cut()
        raise Interrupted(_save_finished(rt, out, run, stop.finished, token_lists, stream is not None)) from None
    _drop_unused(lat, config)
    if stream is not None:
        stream.end(_request_json(rt, results[0]))
    peak, peak_src = peak_memory(rt.device)
    doc = {
        "model": run.model.name, "device": str(rt.device), "tp": rt.tp,
        "dtype": str(rt.dtype).replace("torch.", ""), "gamma": config.gamma, "graphs": config.graphs,
        "compile": config.compile, "compile_mode": config.compile_mode,
        "batch_size": config.batch_size, "schedule": config.schedule, "gamma_policy": config.gamma_policy,
        "synthetic_acceptance": config.synthetic_acceptance,
        "config": {"model": dataclasses.asdict(run.model), "engine": config.to_json()},
        "requests": [_request_json(rt, r) for r in results],
        "acceptance": acc.to_json(),
        "latency": lat,
        "memory": {"weights_bytes": rt.weight_bytes(), "per_sequence_bytes": per_seq, "pool_bytes": pool_bytes,
                   "peak_bytes": peak, "peak_source": peak_src, "alloc": config.alloc},
    }
    if run.compare:
        if not run.json_out:
            Console(stderr=True).print("[dim]running gamma 0 for --compare[/dim]")
        try:
            base, _, base_lat, _, _ = run_generate(rt, token_lists, config.replace(gamma=0), constraints=constraints)
        except Stopped:
            raise Interrupted(_save_finished(rt, out, run, results, token_lists, stream is not None,
                                             "the --compare run")) from None
        _drop_unused(base_lat, config)
        doc["compare"] = compare_block(lat, base_lat, [r.tokens for r in results] == [r.tokens for r in base])
    if run.trace is not None:
        _write_trace(run.trace, [row for r in results for row in r.trace])
    if run.json_out:
        sys.stdout.write(json.dumps(doc) + "\n")
    else:
        if stream is None:
            _list_replies(rt, out, doc["requests"], token_lists)
        out.rule(style="dim")
        print_tables(out, doc, acc)
    output_complete()  # a Ctrl-C from here (the model freed, the interpreter's exit) leaves exit 0


@contextlib.contextmanager
def _progress(most_tokens: int, enabled: bool):
    """A prompt set's progress on stderr (transient; Rich draws nothing when stderr is no terminal):
    -> the engine's on_tokens callback counting new tokens, or None."""
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("generating"), BarColumn(), TextColumn("{task.completed:,} tokens (at most {task.total:,})"),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as prog:
        task = prog.add_task("tokens", total=most_tokens)
        yield lambda request_id, new_ids: prog.advance(task, len(new_ids))


def _request_json(rt, r) -> dict:
    doc = {"id": r.request_id, "prompt_tokens": r.prompt_tokens, "tokens": r.tokens,
           "text": rt.tokenizer.decode(r.tokens) if rt.tokenizer else None, "finish_reason": r.finish_reason}
    if r.constraint is not None:
        doc.update(constraint=r.constraint, complete=r.complete, valid=r.valid)
    return doc


def _list_replies(rt, out: Console, requests: list[dict], token_lists: list[list[int]]) -> None:
    """Each request's reply (its JSON document's entry) under a rule naming it, after its prompt's
    end, then how it finished."""
    for r in requests:
        text = r["text"] if r["text"] is not None else ",".join(map(str, r["tokens"]))
        out.rule(f"request {r['id']}: {r['prompt_tokens']} prompt tokens", align="left", style="dim")
        if rt.tokenizer is not None:  # the prompt's end, dim, as a streamed reply shows it
            out.print(_prompt_tail(rt, token_lists[r["id"]]), style="dim", end="", highlight=False, markup=False)
        out.print(text + _cut_mark(r), highlight=False, markup=False)
        _print_ending(out, r)


def _save_finished(rt, out: Console, run: GenerateRun, finished: list, token_lists: list[list[int]],
                   streamed: bool, during: str = "") -> str:
    """After Ctrl-C: the finished requests' steps to --trace, and to stdout their JSON (--json) or
    their replies as a complete run lists them (a streamed one is on the screen already) -> the
    line that says so."""
    where = []
    if run.trace is not None and finished:
        _write_trace(run.trace, [row for r in finished for row in r.trace])
        where.append(f"their steps are in {run.trace}")
    if run.json_out:
        sys.stdout.write(json.dumps({"model": run.model.name, "interrupted": True,
                                     "requests": [_request_json(rt, r) for r in finished]}) + "\n")
        where.append("their JSON is on stdout")
    elif finished and not streamed:
        _list_replies(rt, out, [_request_json(rt, r) for r in finished], token_lists)
        where.append("their replies are on stdout")
    done = f"{len(finished)} of {len(token_lists)} requests had finished" + (f" before {during}" if during else "")
    return "; ".join([done] + (where or ["nothing was written"]))


def _drop_unused(lat: dict, config) -> None:
    """Latency keys that mean nothing in this run: no capture when eager, no compile when off."""
    if config.graphs == "eager":
        lat.pop("graph_capture_ms", None)
    if config.compile == "off":
        lat.pop("compile_s", None)


def _finish(reason: str) -> str:
    return {"length": "length (--max-new-tokens reached)", "eos": "eos (the model ended it)",
            "grammar": "grammar (the constraint admits nothing more)"}.get(reason, reason)


def _print_ending(out: Console, r: dict) -> None:
    """How a reply ended, on lines of their own under it (a rule's title would cut them at 80
    columns): the finish and its length, then a constrained reply's verdict."""
    n = len(r["tokens"])
    out.print(f"finish: {_finish(r['finish_reason'])}, {n} new token{'s' if n != 1 else ''}", style="dim",
              highlight=False, markup=False)
    if r.get("constraint") is not None:
        text, style = _verdict(r)
        out.print(f"{r['constraint']}: {text}", style=style, highlight=False, markup=False)


def _verdict(r: dict) -> tuple[str, str]:
    """A constrained reply's `complete` and `valid` in words, and their colour."""
    if r["complete"]:
        return ("complete, valid", "green") if r["valid"] else ("complete, NOT valid", "red")
    # complete needs the grammar's end or an accepted EOS: an EOS before it means the trigger never came
    why = {"length": "cut", "eos": "--constrain-after's token never came"}.get(r["finish_reason"], r["finish_reason"])
    return f"incomplete ({why}), not checked", "yellow"


def _cut_mark(r: dict) -> str:
    """' …' after text cut by the token limit in the middle of a word or line."""
    text = r.get("text")
    if r["finish_reason"] != "length" or not text or text[-1].isspace():
        return ""
    return " …[cut]"


def _header(out: Console, model: str, rt, config) -> None:
    s = config.sampling
    how = "greedy" if s.temperature == 0 else f"T {s.temperature:g}, top-p {s.top_p:g}, seed {s.seed}"
    name = Path(model).name if "/" in model and Path(model).exists() else model
    synthetic = f", synthetic acceptance {_rates_text(config)}" if config.synthetic_acceptance else ""
    out.rule(f"{name}, {rt.device}, gamma {config.gamma}{synthetic}, {how}, max {config.max_new_tokens} new tokens",
             align="left", style="dim")


def _rates_text(config) -> str:
    return ",".join(f"{p:g}" for p in config.synthetic_acceptance)


def _has_template(rt) -> bool:
    return rt.tokenizer is not None and bool(rt.tokenizer.config.get("chat_template"))


def _conversation(rt, out: Console, run: GenerateRun) -> None:
    """Run the conversations with the chosen carry and, for comparison, without; report per turn."""
    from glm5mtp_cli.diagnostics.report import conversation_doc, conversation_table
    from glm5mtp_cli.engine.conversation import run_conversations

    convs, json_out, trace = run.conversations, run.json_out, run.trace
    use_template = run.chat or _has_template(rt)
    chats, info = run_conversations(rt, convs, run.engine, run.carry, run.carry_budget, use_template)
    base = chats
    if run.carry != "none":
        base, _ = run_conversations(rt, convs, run.engine, "none", run.carry_budget, use_template)
    doc = conversation_doc(chats, base, info, rt.tokenizer)
    if trace is not None:
        _write_trace(trace, [dict(row, conversation=ci, turn=ti + 1) for ci, c in enumerate(chats)
                             for ti, t in enumerate(c.turns) for row in t.trace])
    if json_out:
        sys.stdout.write(json.dumps(doc) + "\n")
    else:
        for ci, conv in enumerate(doc["conversations"]):
            for ti, turn in enumerate(conv["turns"]):
                text = turn["text"] if turn["text"] is not None else ",".join(map(str, turn["tokens"]))
                out.rule(f"chat {ci}, turn {ti + 1}: reply of {len(turn['tokens'])} tokens, finish: "
                         f"{_finish(turn['finish_reason'])}", align="left", style="dim")
                out.print(text + _cut_mark(turn), highlight=False, markup=False)
        out.rule(style="dim")
        out.print(conversation_table(doc))
        if not doc["carry"]["same_tokens_as_no_carry"]:
            out.print("[red]carried turns produced different tokens from fresh turns[/red]")
    output_complete()


def _prompt_tail(rt, ids: list[int]) -> str:
    """The prompt's last 200 characters, where its reply continues."""
    text = rt.tokenizer.decode(ids)
    return ("…" + text[-200:]) if len(text) > 200 else text


class _Streamer:
    """Prints the prompt's end, then decoded text as verify steps accept tokens (one request only)."""

    def __init__(self, rt, console: Console, prompt_ids: list[int]):
        self.rt = rt
        self.console = console
        self.ids: list[int] = []
        self.printed = ""
        console.print(_prompt_tail(rt, prompt_ids), style="dim", end="", highlight=False, markup=False)

    def __call__(self, request_id: int, new_ids: list[int]) -> None:
        self.ids += new_ids
        text = self.rt.tokenizer.decode(self.ids)
        if text.startswith(self.printed):
            self.console.out(text[len(self.printed):], end="", highlight=False)
            self.printed = text

    def cut(self) -> None:
        """Ctrl-C: end the streamed line, so what comes next starts on its own."""
        self.console.out("")

    def end(self, r: dict) -> None:
        """r: the request's JSON document entry."""
        self.console.out(_cut_mark({"finish_reason": r["finish_reason"], "text": self.printed}), highlight=False)
        _print_ending(self.console, r)


def _write_trace(path: Path, rows: list[dict]) -> None:
    try:
        with path.open("w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    except OSError as e:
        raise UserError(f"--trace {path}: {e.strerror}") from None
