"""`glm5mtp generate`: speculative generation with acceptance, latency and memory tables."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Annotated, Optional

import torch
import typer
from rich.console import Console

from glm5mtp_cli.engine import launch
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.jsonl import read_jsonl
from glm5mtp_cli.engine.launch import TpOpt
from glm5mtp_cli.engine.draft_vocab import load_draft_ids
from glm5mtp_cli.engine.conversation import read_conversations, run_conversations
from glm5mtp_cli.diagnostics.report import conversation_table, print_tables, summarize
from glm5mtp_cli.engine.runtime import DEFAULT_MODEL, Runtime, graph_mode, load_runtime, make_engine
from glm5mtp_cli.engine.sampling import SamplingParams
from glm5mtp_cli.engine.speculate import Request, reserve_tokens

ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Profile name, local folder or Hub repo id.")]
DeviceOpt = Annotated[str, typer.Option(help="cpu, cuda, cuda:N or auto.")]
DtypeOpt = Annotated[str, typer.Option(help="auto (bf16 on CUDA, fp32 on CPU), fp32, bf16, fp16.")]


def read_prompts(rt: Runtime, prompt: str | None, prompt_ids: str | None, prompts_file: Path | None,
                 chat: bool) -> list[list[int]]:
    given = [x is not None for x in (prompt, prompt_ids, prompts_file)]
    if sum(given) != 1:
        raise UserError("give exactly one of --prompt, --prompt-ids, --prompts")
    if prompt_ids is not None:
        try:
            return [[int(x) for x in prompt_ids.split(",") if x.strip()]]
        except ValueError:
            raise UserError(f"--prompt-ids: expected comma-separated integers, got {prompt_ids!r}") from None
    items: list[dict]
    if prompt is not None:
        items = [{"prompt": prompt}]
    else:
        items = read_jsonl(prompts_file)
    if rt.tokenizer is None:
        raise UserError(f"{rt.resolved.folder}: no tokenizer.json; use --prompt-ids")
    out = []
    for i, item in enumerate(items):
        if "messages" in item or chat:
            messages = item.get("messages") or [{"role": "user", "content": item.get("prompt", "")}]
            text = rt.tokenizer.apply_chat_template(messages)
        elif isinstance(item.get("prompt"), str):
            text = item["prompt"]
        else:
            raise UserError(f"{prompts_file}: line {i + 1} needs a 'prompt' string or a 'messages' list")
        out.append(rt.tokenizer.encode(text))
    return out


def check_flags(gamma: int, max_new_tokens: int, temperature: float, top_p: float, batch_size: int,
                draft_conf_tau: float | None) -> None:
    if gamma < 0 or gamma > 16:
        raise UserError(f"--gamma must be in 0..16, got {gamma}")
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1], got {top_p}")
    if batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {batch_size}")
    if draft_conf_tau is not None and not 0 <= draft_conf_tau <= 1:
        raise UserError(f"--draft-conf-tau must be in [0, 1], got {draft_conf_tau}")


def peak_memory(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "rss"


def run_generate(rt: Runtime, prompts: list[list[int]], *, gamma: int, max_new_tokens: int, sampling: SamplingParams,
                 batch_size: int, max_seq_len: int, alloc: str, draft_conf_tau: float | None, ignore_eos: bool,
                 on_tokens=None, draft_vocab: int | None = None, graphs: str = "eager"):
    """One engine over all prompts. Returns (results, acceptance, latency json, per-sequence bytes, pool bytes)."""
    draft_ids = None
    if draft_vocab is not None and gamma > 0:
        draft_ids = load_draft_ids(rt.resolved.folder, draft_vocab, rt.cfg.vocab_size, rt.device)
    requests = [Request(p, max_new_tokens, i) for i, p in enumerate(prompts)]
    per_seq = max(reserve_tokens(len(r.prompt), r.max_new_tokens, gamma, alloc, max_seq_len) for r in requests)
    pools = rt.make_pools(per_seq, min(batch_size, len(requests)))
    engine = make_engine(rt, pools, gamma=gamma, sampling=sampling, max_seq_len=max_seq_len,
                        alloc=alloc, draft_conf_tau=draft_conf_tau, eos_ids=[] if ignore_eos else None,
                        device=rt.device, draft_ids=draft_ids, graphs=graphs)
    engine.on_tokens = on_tokens
    results = engine.generate(requests, batch_size=batch_size)
    acc, lat = summarize(results, gamma, engine.wall_prefill_s, engine.wall_decode_s, engine.wall_capture_s)
    leftover = pools.blocks_held()
    if any(leftover.values()):
        raise RuntimeError(f"cache blocks still held after generate: {leftover}")
    return results, acc, lat.to_json(), results[0].state_bytes, pools.bytes_total()


def generate_cmd(
    prompt: Annotated[Optional[str], typer.Option(help="Prompt text (needs the checkpoint's tokenizer).")] = None,
    model: ModelOpt = DEFAULT_MODEL,
    prompt_ids: Annotated[Optional[str], typer.Option(help="Comma-separated token ids.")] = None,
    prompts: Annotated[Optional[Path], typer.Option(help='JSONL: {"prompt": ...} or {"messages": [...]} per line.')] = None,
    chat: Annotated[bool, typer.Option(help="Wrap prompts in the checkpoint's chat template.")] = False,
    gamma: Annotated[int, typer.Option(help="Drafts per verify step (0: no speculation).")] = 3,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate per request.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    seed: Annotated[int, typer.Option()] = 0,
    draft_conf_tau: Annotated[Optional[float], typer.Option(help="Stop a draft chain below this top-1 probability.")] = None,
    batch_size: Annotated[int, typer.Option(help="Requests decoded together.")] = 1,
    max_seq_len: Annotated[Optional[int], typer.Option(help="Ceiling on prompt + new tokens (default: the model's).")] = None,
    alloc: Annotated[str, typer.Option(help="budget: size state to each request; ceiling: to --max-seq-len.")] = "budget",
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    layers: Annotated[Optional[int], typer.Option(help="Use only the first K target layers.")] = None,
    revision: Annotated[Optional[str], typer.Option(help="Hub revision.")] = None,
    ignore_eos: Annotated[bool, typer.Option(help="Generate max-new-tokens whatever the model says.")] = False,
    compare: Annotated[bool, typer.Option(help="Also run gamma 0 and report the speedup.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="One JSON document on stdout, nothing else there.")] = False,
    trace: Annotated[Optional[Path], typer.Option(help="JSON lines, one per verify step per request.")] = None,
    tp: TpOpt = 1,
    conversation: Annotated[Optional[Path], typer.Option(help='JSONL: {"turns": ["...", ...]} per line; each reply is appended before the next turn.')] = None,
    carry: Annotated[str, typer.Option(help="With --conversation: keep caches between turns: all (target + drafter), drafter, none.")] = "none",
    carry_budget: Annotated[Optional[int], typer.Option(help="Bytes of held carries; least recently used are freed past it.")] = None,
    draft_vocab: Annotated[Optional[int], typer.Option(help="Draft over the K most frequent tokens (token_counts.json beside the checkpoint).")] = None,
    cuda_graphs: Annotated[bool, typer.Option("--cuda-graphs/--no-cuda-graphs",
                                              help="On CUDA, replay decode, verify and draft forwards as CUDA graphs.")] = True,
    random_weights: Annotated[bool, typer.Option(help="Random weights of the model's config, built on the device "
                                                      "(real dimensions without a checkpoint, e.g. --model glm5 --layers 4).")] = False,
) -> None:
    """Speculative generation: the MTP head drafts, the target verifies; output equals the target's."""
    kwargs = dict(locals())
    check_flags(gamma, max_new_tokens, temperature, top_p, batch_size, draft_conf_tau)
    if alloc not in ("budget", "ceiling"):
        raise UserError(f"--alloc must be 'budget' or 'ceiling', got {alloc!r}")
    if launch.maybe_spawn(tp, device, model, generate_cmd, kwargs):
        return
    out = Console(stderr=json_out)
    rt = load_runtime(model, device, dtype, layers, revision, with_mtp=gamma > 0 or compare, progress=not json_out,
                      comm=launch.rank_comm(tp, device), random_weights=random_weights)
    seq_cap = max_seq_len or rt.cfg.max_position_embeddings
    if seq_cap < 2:
        raise UserError(f"--max-seq-len must be >= 2, got {seq_cap}")
    if conversation is not None:
        if any(x is not None for x in (prompt, prompt_ids, prompts)):
            raise UserError("--conversation replaces --prompt, --prompt-ids and --prompts")
        run_conversation_cmd(rt, out, conversation, json_out, gamma=gamma, max_new_tokens=max_new_tokens,
                             sampling=SamplingParams(temperature, top_p, seed), max_seq_len=seq_cap, alloc=alloc,
                             carry=carry, carry_budget=carry_budget, use_template=chat or _has_template(rt),
                             ignore_eos=ignore_eos)
        return
    if carry != "none":
        raise UserError("--carry needs --conversation")
    token_lists = read_prompts(rt, prompt, prompt_ids, prompts, chat)
    sampling = SamplingParams(temperature, top_p, seed)
    stream = None
    if rt.tokenizer is not None and not json_out and len(token_lists) == 1:
        stream = _Streamer(rt, out)
    kwargs = dict(max_new_tokens=max_new_tokens, sampling=sampling, batch_size=batch_size, max_seq_len=seq_cap,
                  alloc=alloc, draft_conf_tau=draft_conf_tau, ignore_eos=ignore_eos, draft_vocab=draft_vocab,
                  graphs=graph_mode(rt, cuda_graphs))
    results, acc, lat, per_seq, pool_bytes = run_generate(rt, token_lists, gamma=gamma, on_tokens=stream, **kwargs)
    if stream:
        stream.end()
    peak, peak_src = peak_memory(rt.device)
    doc = {
        "model": model, "device": str(rt.device), "tp": rt.comm.world if rt.comm else 1, "dtype": str(rt.dtype).replace("torch.", ""), "gamma": gamma,
        "graphs": kwargs["graphs"],
        "requests": [{"id": r.request_id, "prompt_tokens": r.prompt_tokens, "tokens": r.tokens,
                      "text": rt.tokenizer.decode(r.tokens) if rt.tokenizer else None,
                      "finish_reason": r.finish_reason} for r in results],
        "acceptance": acc.to_json(),
        "latency": lat,
        "memory": {"weights_bytes": rt.weight_bytes(), "per_sequence_bytes": per_seq, "pool_bytes": pool_bytes,
                   "peak_bytes": peak, "peak_source": peak_src, "alloc": alloc},
    }
    if compare:
        base, _, base_lat, _, _ = run_generate(rt, token_lists, gamma=0, **kwargs)
        ratio = lambda a, b: a / b if a and b else None  # noqa: E731
        doc["compare"] = {"baseline": base_lat,
                          "speedup_decode": ratio(lat["decode_tokens_per_s"], base_lat["decode_tokens_per_s"]),
                          "speedup_e2e": ratio(lat["e2e_tokens_per_s"], base_lat["e2e_tokens_per_s"]),
                          "same_tokens": [r.tokens for r in base] == [r.tokens for r in results]}
    if trace is not None:
        _write_trace(trace, results)
    if json_out:
        sys.stdout.write(json.dumps(doc) + "\n")
        return
    if stream is None:
        for r in doc["requests"]:
            out.print(f"[bold]request {r['id']}[/bold] ({r['prompt_tokens']} prompt tokens, {r['finish_reason']}):")
            out.print(r["text"] if r["text"] is not None else ",".join(map(str, r["tokens"])),
                      highlight=False, markup=False)
    print_tables(out, doc, acc)


def _has_template(rt: Runtime) -> bool:
    return rt.tokenizer is not None and bool(rt.tokenizer.config.get("chat_template"))


def run_conversation_cmd(rt: Runtime, out: Console, path: Path, json_out: bool, **kwargs) -> None:
    """Run the conversations with the chosen carry and, for comparison, without; report per turn."""
    convs = read_conversations(path)
    chats, info = run_conversations(rt, convs, **kwargs)
    base = chats
    if kwargs["carry"] != "none":
        base, _ = run_conversations(rt, convs, **{**kwargs, "carry": "none"})
    same = all(a.tokens == b.tokens for ca, cb in zip(chats, base) for a, b in zip(ca.turns, cb.turns))
    doc = {"carry": {**info, "same_tokens_as_no_carry": same}, "conversations": [
        {"turns": [{"tokens": t.tokens, "text": rt.tokenizer.decode(t.tokens) if rt.tokenizer else None,
                    "prompt_tokens": len(t.prompt), "prefilled_target_rows": t.prefilled_target_rows,
                    "prefilled_drafter_rows": t.prefilled_drafter_rows, "carried_rows": t.carried_target_rows,
                    "carried_drafter_rows": t.carried_drafter_rows, "ttft_ms": t.ttft_s * 1e3,
                    "ttft_ms_no_carry": b.ttft_s * 1e3, "finish_reason": t.finish_reason}
                   for t, b in zip(c.turns, cb.turns)]} for c, cb in zip(chats, base)]}
    if json_out:
        sys.stdout.write(json.dumps(doc) + "\n")
        return
    out.print(conversation_table(doc))
    if not same:
        out.print("[red]carried turns produced different tokens from fresh turns[/red]")


class _Streamer:
    """Prints decoded text as verify steps accept tokens (one request only)."""

    def __init__(self, rt: Runtime, console: Console):
        self.rt = rt
        self.console = console
        self.ids: list[int] = []
        self.printed = ""

    def __call__(self, request_id: int, new_ids: list[int]) -> None:
        self.ids += new_ids
        text = self.rt.tokenizer.decode(self.ids)
        if text.startswith(self.printed):
            self.console.out(text[len(self.printed):], end="", highlight=False)
            self.printed = text

    def end(self) -> None:
        self.console.out("")


def _write_trace(path: Path, results) -> None:
    try:
        with path.open("w") as f:
            for r in results:
                for row in r.trace:
                    f.write(json.dumps(row) + "\n")
    except OSError as e:
        raise UserError(f"--trace {path}: {e.strerror}") from None
