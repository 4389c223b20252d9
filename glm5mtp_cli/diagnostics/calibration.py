"""`plan`'s efficiencies, fitted on measured runs (`plan --calibrate FILE...`), so other hardware scales
from a measured GPU's behaviour (the shipped fit: an H100's) instead of datasheet peaks.

What a fit reads: `bench --json` documents (their real-dimension `draft_step` / `target_step`, timed as
graph replays: device time only, with `--kernels` their kernel count) and the fixed-gamma rows of
`bench --json` / `generate --json` end-to-end runs (a step: the run's decode wall time over its steps,
at the mean number of sequences a step decoded; _run_step). What it fits, by least squares on relative
errors, alternating until it settles:

- the achieved fraction of the memory bandwidth per kind of forward: `draft` from draft steps, `decode`
  from target steps (verify and prefill forwards use it too), each also `_fp8` from FP8 steps when
  some are given (FP8 forwards fall back to the bf16 value otherwise);
- the cost of one kernel replayed from a graph, and the engine's host time per step, per forward (a
  graph replay's call) and per sequence (the last only when some run decodes more than one sequence
  at a time; else its prior, below);
- the share of the expert reads the few-pair MoE kernels repeat (one per (token, expert) pair beyond
  the distinct experts: sizing.reread_experts_factor) that costs what a first read does, in [0, 1]
  (at most all of them: a repeat is never dearer than the first read), when some forward of the fit
  runs those kernels over more than one token.

The compute efficiency is not fitted (no measured step is compute bound): COMPUTE_EFFICIENCY, assumed.
Kernel counts per family (what `plan` multiplies the per-kernel cost by) are read from the files'
`--kernels` tables: the draft step's, and the target step's per layer (its calls / its layers: the
head's and embedding's kernels spread over the layers). Re-calibrate when kernels change.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

from glm5mtp_cli.errors import UserError
from glm5mtp_cli.input_file import read_text
from glm5mtp_cli.jsonl import read_json

DEFAULT_PATH = Path(__file__).with_name("plan_calibration_h100.json")
COMPUTE_EFFICIENCY = 0.5  # assumed: no measured step here is compute bound
# ~17 us per sequence-step: the step loop's host time without forwards (diagnostics/host_time on the
# 2-core CPU, profiles/glm5-nano/RESULTS.md "the step loop's own host time"): the prior when no run
# given to a fit decodes more than one sequence.
HOST_SEQUENCE_PRIOR_S = 17e-6


@dataclass(frozen=True)
class Calibration:
    hardware: str
    bandwidth_efficiency: dict  # kind ('draft', 'decode') -> achieved fraction of the datasheet bandwidth
    per_kernel_s: float
    host_step_s: float
    host_forward_s: float
    host_sequence_s: float
    kernels: dict  # model_type -> {'draft': n, 'target_per_layer': n, 'source': file}
    compute_efficiency: float = COMPUTE_EFFICIENCY
    # each sequence of each draft forward of a run: the drafter's per-row bookkeeping and gathers,
    # which steps with drafting at batch > 1 pay beyond the bytes they read
    draft_sequence_s: float = 0.0
    # the few-pair MoE kernels (kernels/moe.py) stream an expert once per (token, expert) pair: the
    # share of the repeats beyond the distinct experts (sizing.reread_experts_factor) that costs what a
    # first read does (the rest: L2 hits, taken as free), fitted in [0, 1]; 0 (repeats free) in a
    # calibration fitted before the term
    reread_fraction: float = 0.0
    fitted: dict = field(default_factory=dict)  # commit, files, what each value came from
    residuals: list = field(default_factory=list)  # the fit's own measurements beside its predictions

    def efficiency(self, kind: str, fp8: bool) -> float:
        return self.bandwidth_efficiency[efficiency_key(kind, fp8, self.bandwidth_efficiency)]

    def kernels_for(self, family: str) -> dict:
        if family not in self.kernels:
            raise UserError(f"no kernel counts for model family {family!r} in the calibration (known: "
                            f"{', '.join(self.kernels)}); calibrate with a `bench --kernels --json` of it")
        return self.kernels[family]

    def summary(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "residuals"}


def load(path: Path | None = None) -> Calibration:
    """The shipped calibration (an H100's, at the current kernels), or --calibration FILE (a `plan
    --calibrate --out` document)."""
    p = Path(path) if path is not None else DEFAULT_PATH
    text = read_text(p, "--calibration")
    try:
        return Calibration(**json.loads(text))
    except (json.JSONDecodeError, TypeError) as e:
        raise UserError(f"--calibration {p}: not a `plan --calibrate` document ({e})") from None


def efficiency_key(kind: str, fp8: bool, fitted) -> str:
    """The efficiency a forward of `kind` uses: draft's (draft, catch-up) or decode's (verify, prefill),
    FP8's when fitted."""
    base = "draft" if kind in ("draft", "catchup") else "decode"
    return f"{base}_fp8" if fp8 and f"{base}_fp8" in fitted else base


# ---- measurements -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Measurement:
    """One measured time `plan`'s model predicts: a step (device time of one forward) or a run's
    decode step (wall time, host included)."""

    source: str
    what: str
    model: str
    layers: int | None
    fp8: bool
    kind: str  # 'draft' or 'decode' (one forward, batch 1), 'run' (a decode step of a run)
    seconds: float
    context: int
    kernels: float | None = None  # a step's measured kernel count
    seqs: float = 1.0  # a run's: the mean sequences a step decoded
    gamma: int = 0
    tokens_per_step: float = 1.0  # a run's: sequences x mean acceptance length


def read_measurements(path: Path, option: str = "--calibrate") -> list[Measurement]:
    """Every measurement of one `bench --json` or `generate --json` document (`option`: the flag that
    named it, for the error)."""
    doc = read_json(path, option)
    if not isinstance(doc, dict) or "model" not in doc:
        raise UserError(f"{option} {path}: expected a `bench --json` or `generate --json` document")
    out = _steps(str(path), doc) + _bench_rows(str(path), doc) + _generate_run(str(path), doc)
    if not out:
        raise UserError(f"{option} {path}: no step timings and no fixed-gamma decode rows in it")
    return out


def _steps(src: str, doc: dict) -> list[Measurement]:
    """The document's full-vocabulary draft steps and its target steps, at each batch they were timed
    at (bench --step-batch-sizes; older documents: the one batch-1 step of each)."""
    fp8 = bool(doc.get("fp8_weights"))
    out = []
    for key, kind in (("draft_step", "draft"), ("target_step", "decode")):
        steps = doc.get(key + "s") or [doc.get(key)]
        for step in steps:
            if not step or not step.get("step_ms") or step.get("draft_vocab"):
                continue
            layers, batch = step.get("layers"), step.get("batch", 1)
            calls = (step.get("kernels") or {}).get("calls_per_step")
            what = (f"{key.replace('_', ' ')}" + (f" ({layers} layers)" if layers else "") + (" fp8" if fp8 else "")
                    + (f", batch {batch}" if batch > 1 else ""))
            out.append(Measurement(src, what, doc["model"], layers if kind == "decode" else 1, fp8, kind,
                                   step["step_ms"] / 1e3, step["context"], calls, seqs=batch))
    return out


def _bench_rows(src: str, doc: dict) -> list[Measurement]:
    out = []
    # bench does not record prompt lengths: max_new_tokens stands for the context (the shipped nano
    # models' cache reads are < 1% of a step's bytes either way)
    context = int(doc.get("max_new_tokens") or 128)
    for r in doc.get("rows") or []:
        fixed = r.get("gamma") == 0 or r.get("gamma_policy") == "fixed"
        if r.get("gamma") is None or not fixed or not r.get("decode_tokens_per_s") or r.get("system") == "transformers":
            continue
        slots = min(r["batch"], r.get("prompts") or r["batch"])
        step_s, seqs = _run_step(r, r["mean_acceptance_length"], slots)
        out.append(Measurement(src, f"batch {r['batch']} gamma {r['gamma']} step", doc["model"], None,
                               bool(doc.get("fp8_weights")), "run", step_s, context, seqs=seqs, gamma=r["gamma"],
                               tokens_per_step=seqs * r["mean_acceptance_length"]))
    return out


def _run_step(timing: dict, mal: float, slots: int) -> tuple[float, float]:
    """(seconds, sequences) of a run's mean decode step. With the run's step count (`gamma_steps`):
    its decode wall time over its steps, at the mean number of sequences a step decoded (the
    sequence-steps, decode tokens / mean acceptance length, over the steps). Slots stand idle
    between a finish and the next admission and in the run's tail, more at gamma > 0, whose
    requests end at different steps: counting every slot busy, a batch-64 gamma-3 run on glm5-nano
    read 4.15 ms for a step of 3.21 ms over 50 sequences. Older documents: every slot busy."""
    steps = sum((timing.get("gamma_steps") or {}).values())
    wall = timing.get("wall_decode_s")
    if not steps or not wall:
        return slots * mal / timing["decode_tokens_per_s"], float(slots)
    return wall / steps, timing["decode_tokens_per_s"] * wall / (mal * steps)


def _generate_run(src: str, doc: dict) -> list[Measurement]:
    lat, conf = doc.get("latency"), doc.get("config")
    if not lat or not conf or not lat.get("decode_tokens_per_s"):
        return []
    model, engine = conf["model"], conf["engine"]
    requests = doc.get("requests") or []
    acc = doc.get("acceptance")
    mal = acc["mean_acceptance_length"] if acc else 1.0
    step_s, seqs = _run_step(lat, mal, min(engine["batch_size"], len(requests) or 1))
    prompt = sum(r["prompt_tokens"] for r in requests) / max(len(requests), 1)
    context = int(prompt + engine["max_new_tokens"] / 2)  # the mean position a decode step reads at
    return [Measurement(src, f"batch {engine['batch_size']} gamma {doc['gamma']} step"
                        + (" (synthetic acceptance)" if doc.get("synthetic_acceptance") else ""),
                        model["name"], model.get("layers"), bool(model.get("fp8")), "run",
                        step_s, context, seqs=seqs, gamma=doc["gamma"], tokens_per_step=seqs * mal)]


# ---- the fit -----------------------------------------------------------------------------------

def kernel_counts(measurements: list[Measurement], family_of_model) -> dict:
    """Per family: the draft step's kernels and the target step's per layer, the mean over the files
    that counted them (`bench --kernels`) at batch 1."""
    seen: dict[str, dict[str, list]] = {}
    for m in measurements:
        if m.kernels is None or m.kind == "run" or m.seqs > 1:
            continue
        fam = seen.setdefault(family_of_model(m), {"draft": [], "target_per_layer": [], "source": []})
        fam["draft" if m.kind == "draft" else "target_per_layer"].append(
            m.kernels if m.kind == "draft" else m.kernels / m.layers)
        fam["source"].append(m.source)
    return {f: {"draft": sum(v["draft"]) / len(v["draft"]),
                "target_per_layer": sum(v["target_per_layer"]) / len(v["target_per_layer"]),
                "source": sorted(set(v["source"]))}
            for f, v in seen.items() if v["draft"] and v["target_per_layer"]}


def file_record(path: str) -> dict:
    return {"path": path, "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]}


def head_commit() -> str | None:
    """This checkout's commit (the code that fitted), None outside git."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).parent).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def to_json(cal: Calibration) -> str:
    return json.dumps(asdict(cal), indent=1) + "\n"
