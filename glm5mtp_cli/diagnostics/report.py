"""What generate reports: the JSON blocks computed from a run, and the same numbers as Rich tables
(each fits 80 columns)."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

from glm5mtp_cli.units import fmt_bytes
from glm5mtp_cli.engine.metrics import Acceptance

WIDE = 100  # terminals at least this wide get ruled tables; narrower ones (80 columns, pipes) lighter ones


def fit_table(console: Console, title: str, **kw) -> Table:
    """A table that fits the console: vertical rules only when there is room for them."""
    if console.width < WIDE:
        kw.setdefault("box", box.SIMPLE_HEAD)
        kw.setdefault("pad_edge", False)
    return Table(title=title, **kw)


def _f(x, spec=".3f", none="-"):
    return none if x is None else format(x, spec)


def acceptance_table(acc: Acceptance, synthetic: tuple[float, ...] | None = None) -> Table:
    """synthetic: --synthetic-acceptance's rates, said in the title (drawn, not the models')."""
    how = f"SYNTHETIC, drawn at {','.join(f'{p:g}' for p in synthetic)}: not lossless" if synthetic else "vLLM definitions"
    t = Table(title=f"acceptance (gamma {acc.gamma}, {how})")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("verify steps", str(acc.steps))
    t.add_row("drafts proposed / accepted", f"{acc.proposed} / {acc.accepted}")
    t.add_row("draft acceptance rate", _f(acc.draft_acceptance_rate))
    t.add_row("mean acceptance length", _f(acc.mean_acceptance_length))
    for k, rate in enumerate(acc.per_position, 1):
        t.add_row(f"acceptance at position {k}", _f(rate))
    return t


def latency_table(lat: dict) -> Table:
    t = Table(title="latency (medians; TPOT per request)")
    t.add_column("metric")
    t.add_column("value", justify="right")
    # TTFT runs from the run's start: a request waiting for a slot counts its wait (vLLM counts from arrival)
    rows = [("TTFT (queue + prefill)", "ttft_ms", "ms"), ("prefill", "prefill_ms", "ms"),
            ("propose per draft", "propose_ms_per_draft", "ms"),
            ("verify (gamma+1 tokens)", "verify_ms", "ms"), ("TPOT p50", "tpot_ms_p50", "ms"),
            ("TPOT p99", "tpot_ms_p99", "ms"), ("tokens/s, decode only", "decode_tokens_per_s", ""),
            ("tokens/s, end to end", "e2e_tokens_per_s", ""), ("run: prefill (admissions)", "wall_prefill_s", "s"),
            ("run: decode steps", "wall_decode_s", "s")]
    # one-time setup, outside end to end; only present where it happened (generate drops the others)
    rows += [(label, key, unit) for label, key, unit in (("setup: compiling the forwards", "compile_s", "s"),
                                                         ("setup: CUDA-graph capture", "graph_capture_ms", "ms"))
             if key in lat]
    for label, key, unit in rows:
        v = lat.get(key)
        t.add_row(label, "-" if v is None else f"{v:.2f} {unit}".strip())
    if "admissions" in lat:
        t.add_row("run: admission phases", str(lat["admissions"]))
    if len(lat.get("gamma_steps", {})) > 1:  # --gamma-policy adaptive changed gamma along the run
        t.add_row("run: decode steps by gamma", ", ".join(f"{n} at {g}" for g, n in lat["gamma_steps"].items()))
    return t


def memory_table(mem: dict) -> Table:
    t = Table(title="memory")
    t.add_column("component")
    t.add_column("bytes", justify="right")
    for k, v in mem["weights_bytes"].items():
        t.add_row(f"weights: {k}", fmt_bytes(v))
    for k, v in mem["per_sequence_bytes"].items():
        t.add_row(f"per sequence: {k}", fmt_bytes(v))
    t.add_row("cache pools (all sequences)", fmt_bytes(mem["pool_bytes"]))
    t.add_row("peak" + (" (CUDA allocator)" if mem.get("peak_source") == "cuda" else " (process RSS)"),
              fmt_bytes(mem.get("peak_bytes")))
    return t


def print_tables(console: Console, doc: dict, acc: Acceptance) -> None:
    if doc["gamma"] > 0:
        console.print(acceptance_table(acc, doc.get("synthetic_acceptance")))
    console.print(latency_table(doc["latency"]))
    console.print(memory_table(doc["memory"]))
    cmp = doc.get("compare")
    if cmp:
        t = Table(title="against gamma 0 (same engine, same requests)")
        for c in ("", "decode tok/s", "e2e tok/s", "TPOT p50 ms"):
            t.add_column(c, justify="right")
        for name, lat in (("gamma 0", cmp["baseline"]), (f"gamma {doc['gamma']}", doc["latency"])):
            t.add_row(name, _f(lat["decode_tokens_per_s"], ".1f"), _f(lat["e2e_tokens_per_s"], ".1f"),
                      _f(lat["tpot_ms_p50"], ".2f"))
        t.add_row("speedup", _f(cmp["speedup_decode"], ".2f") + "x", _f(cmp["speedup_e2e"], ".2f") + "x", "")
        t.add_row("same tokens", "[green]yes[/green]" if cmp["same_tokens"] else "[red]no[/red]", "", "")
        console.print(t)
        if not cmp["same_tokens"]:
            console.print("[red]speculative output differs from gamma 0[/red]")


def compare_block(lat: dict, base_lat: dict, same_tokens: bool) -> dict:
    """generate --compare's JSON block: speculation's latency against gamma 0's on the same engine."""

    def ratio(a, b):
        return a / b if a and b else None

    return {"baseline": base_lat,
            "speedup_decode": ratio(lat["decode_tokens_per_s"], base_lat["decode_tokens_per_s"]),
            "speedup_e2e": ratio(lat["e2e_tokens_per_s"], base_lat["e2e_tokens_per_s"]),
            "same_tokens": same_tokens}


def conversation_doc(chats, base, info: dict, tokenizer) -> dict:
    """generate --conversation's JSON document: per turn, what was prefilled and carried, and the TTFT
    beside the same turn run without a carry (base)."""
    same = all(a.tokens == b.tokens for ca, cb in zip(chats, base) for a, b in zip(ca.turns, cb.turns))
    return {"carry": {**info, "same_tokens_as_no_carry": same}, "conversations": [
        {"turns": [{"tokens": t.tokens, "text": tokenizer.decode(t.tokens) if tokenizer else None,
                    "prompt_tokens": len(t.prompt), "prefilled_target_rows": t.prefilled_target_rows,
                    "prefilled_drafter_rows": t.prefilled_drafter_rows, "carried_rows": t.carried_target_rows,
                    "carried_drafter_rows": t.carried_drafter_rows, "ttft_ms": t.ttft_s * 1e3,
                    "ttft_ms_no_carry": b.ttft_s * 1e3, "finish_reason": t.finish_reason}
                   for t, b in zip(c.turns, cb.turns)]} for c, cb in zip(chats, base)]}


def conversation_table(doc: dict) -> Table:
    c = doc["carry"]
    t = Table(title=f"conversations, carry {c['mode']} (evictions {c['evictions']}; "
                    f"same tokens as no carry: {c['same_tokens_as_no_carry']})",
              caption="prefilled: target / drafter rows computed; carried: target / drafter rows reused")
    for col in ("chat", "turn", "prompt", "prefilled", "carried", "TTFT ms", "no carry"):
        t.add_column(col, justify="right")
    for ci, conv in enumerate(doc["conversations"]):
        for ti, turn in enumerate(conv["turns"]):
            t.add_row(str(ci), str(ti + 1), str(turn["prompt_tokens"]),
                      f"{turn['prefilled_target_rows']} / {turn['prefilled_drafter_rows']}",
                      f"{turn['carried_rows']} / {turn['carried_drafter_rows']}",
                      f"{turn['ttft_ms']:.1f}", f"{turn['ttft_ms_no_carry']:.1f}")
    return t
