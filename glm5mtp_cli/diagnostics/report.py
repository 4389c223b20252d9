"""What generate reports: one JSON document, and the same numbers as Rich tables."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from glm5mtp_cli.diagnostics.sizing import fmt_bytes
from glm5mtp_cli.engine.metrics import Acceptance, Latency
from glm5mtp_cli.engine.speculate import SeqResult


def summarize(results: list[SeqResult], gamma: int, wall_prefill_s: float, wall_decode_s: float,
              wall_capture_s: float = 0.0) -> tuple[Acceptance, Latency]:
    """End to end = prefill + decode; CUDA-graph capture is one-time setup (as in vLLM and SGLang,
    which capture at start-up), reported on its own."""
    acc = Acceptance(gamma)
    lat = Latency()
    for r in results:
        acc.merge(r.acceptance)
        lat.ttft.append(r.ttft_s)
        lat.prefill.append(r.prefill_s)
        lat.propose_per_draft += r.propose_s
        lat.verify += r.verify_s
        if len(r.tokens) > 1:
            lat.tpot.append(r.decode_s / (len(r.tokens) - 1))
    lat.total_tokens = sum(len(r.tokens) for r in results)
    # the first token of each request comes from the prefill; the rest are decode tokens
    lat.decode_tokens = lat.total_tokens - len(results)
    lat.decode_seconds = wall_decode_s
    lat.total_seconds = wall_prefill_s + wall_decode_s
    lat.capture_seconds = wall_capture_s
    return acc, lat


def _f(x, spec=".3f", none="-"):
    return none if x is None else format(x, spec)


def acceptance_table(acc: Acceptance) -> Table:
    t = Table(title=f"acceptance (gamma {acc.gamma}, vLLM definitions)")
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
    rows = [("TTFT", "ttft_ms", "ms"), ("prefill", "prefill_ms", "ms"), ("propose per draft", "propose_ms_per_draft", "ms"),
            ("verify (gamma+1 tokens)", "verify_ms", "ms"), ("TPOT p50", "tpot_ms_p50", "ms"),
            ("TPOT p99", "tpot_ms_p99", "ms"), ("tokens/s, decode only", "decode_tokens_per_s", ""),
            ("tokens/s, end to end", "e2e_tokens_per_s", "")]
    for label, key, unit in rows:
        v = lat.get(key)
        t.add_row(label, "-" if v is None else f"{v:.2f} {unit}".strip())
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
        console.print(acceptance_table(acc))
    console.print(latency_table(doc["latency"]))
    console.print(memory_table(doc["memory"]))
    cmp = doc.get("compare")
    if cmp:
        t = Table(title="speculation against gamma 0 (same engine, same requests)")
        for c in ("", "decode tok/s", "e2e tok/s", "TPOT p50 ms"):
            t.add_column(c, justify="right")
        for name, lat in (("gamma 0", cmp["baseline"]), (f"gamma {doc['gamma']}", doc["latency"])):
            t.add_row(name, _f(lat["decode_tokens_per_s"], ".1f"), _f(lat["e2e_tokens_per_s"], ".1f"),
                      _f(lat["tpot_ms_p50"], ".2f"))
        t.add_row("speedup", _f(cmp["speedup_decode"], ".2f") + "x", _f(cmp["speedup_e2e"], ".2f") + "x", "")
        console.print(t)
        if not cmp["same_tokens"]:
            console.print("[red]speculative output differs from gamma 0[/red]")


def conversation_table(doc: dict) -> Table:
    c = doc["carry"]
    t = Table(title=f"conversations, carry {c['mode']} (evictions {c['evictions']}; "
                    f"same tokens as no carry: {c['same_tokens_as_no_carry']})")
    for col in ("chat", "turn", "prompt", "target rows prefilled", "drafter rows prefilled", "rows carried",
                "TTFT ms", "TTFT ms, no carry"):
        t.add_column(col, justify="right")
    for ci, conv in enumerate(doc["conversations"]):
        for ti, turn in enumerate(conv["turns"]):
            t.add_row(str(ci), str(ti + 1), str(turn["prompt_tokens"]), str(turn["prefilled_target_rows"]),
                      str(turn["prefilled_drafter_rows"]),
                      f"{turn['carried_rows']} / {turn['carried_drafter_rows']}",
                      f"{turn['ttft_ms']:.1f}", f"{turn['ttft_ms_no_carry']:.1f}")
    return t
