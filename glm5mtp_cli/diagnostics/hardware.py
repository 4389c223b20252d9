"""The accelerators `plan` knows (--hardware NAME), each figure beside its source, and the JSON schema of
--hardware-file for the ones it does not.

Figures are per GPU and dense (no 2:4 sparsity): the datasheets quote the sparse tensor figure first,
half of it is the dense one. `link_bytes_per_s` is one direction of one GPU's scale-up link (NVLink,
Infinity Fabric): the rate a ring all-reduce moves data at. `link_latency_s` is no datasheet figure:
it is the order of a small NCCL/RCCL all-reduce within one node (a few microseconds), an assumption
said so in its source. `launch_s` is the device cost of one kernel replayed from a CUDA graph; None
(every entry here) takes the calibration's fitted value (plan_calibration_h100.json: an H100's): the same
front end assumed everywhere, said so in each source.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from glm5mtp_cli.errors import UserError
from glm5mtp_cli.jsonl import read_json

T, G = 1e12, 1e9

ASSUMED_LATENCY = "assumed: a small all-reduce within one node, a few us (no datasheet figure)"
ASSUMED_LAUNCH = "the calibration's per-kernel cost (fitted on the calibration's GPU, assumed elsewhere)"


@dataclass(frozen=True)
class Hardware:
    """One GPU as plan costs it; `sources` names where each figure comes from (field -> text)."""

    name: str
    memory_bytes_per_s: float  # HBM bandwidth
    bf16_flops: float  # dense tensor-core FLOP/s
    fp8_flops: float
    memory_bytes: float  # HBM capacity
    link_bytes_per_s: float  # scale-up link, one direction, per GPU
    link_latency_s: float  # one collective's fixed cost
    launch_s: float | None  # one kernel replayed from a graph (None: the calibration's)
    sources: dict = field(default_factory=dict, compare=False)


# The numeric fields a --hardware-file must give (name, launch_s and sources are optional there).
NUMERIC = ("memory_bytes_per_s", "bf16_flops", "fp8_flops", "memory_bytes", "link_bytes_per_s",
           "link_latency_s")

SCHEMA = ('{"name": "my-gpu", "memory_bytes_per_s": 4.8e12, "bf16_flops": 989e12, "fp8_flops": 1979e12, '
          '"memory_bytes": 141e9, "link_bytes_per_s": 450e9, "link_latency_s": 3e-6, "launch_s": 2e-6, '
          '"sources": {"memory_bytes_per_s": "datasheet ..."}}: every number > 0, SI units (bytes, '
          'bytes/s, FLOP/s dense, seconds); launch_s (per kernel; default: the calibration\'s) and sources '
          'optional')

_H100_H200_SHEET = "NVIDIA H100 / H200 Tensor Core GPU datasheets (SXM), https://www.nvidia.com/en-us/data-center/h200/"
_HGX_B = "NVIDIA HGX B200 / B300 platform specs, https://www.nvidia.com/en-us/data-center/hgx/"
_KLOCKWOOD_B = "per-GPU HGX figures, https://glennklockwood.com/garden/processors/B200 and .../B300"

TABLE: dict[str, Hardware] = {
    "h100": Hardware(
        "h100", 3.35 * T, 989 * T, 1979 * T, 80 * G, 450 * G, 3e-6, None,
        {"memory_bytes_per_s": f"3.35 TB/s HBM3, {_H100_H200_SHEET}",
         "bf16_flops": f"1,979 TFLOPS with sparsity / 2, {_H100_H200_SHEET}",
         "fp8_flops": f"3,958 TFLOPS with sparsity / 2, {_H100_H200_SHEET}",
         "memory_bytes": f"80 GB, {_H100_H200_SHEET}",
         "link_bytes_per_s": f"NVLink 4 900 GB/s bidirectional / 2, {_H100_H200_SHEET}",
         "link_latency_s": ASSUMED_LATENCY, "launch_s": ASSUMED_LAUNCH}),
    "h200": Hardware(
        "h200", 4.8 * T, 989 * T, 1979 * T, 141 * G, 450 * G, 3e-6, None,
        {"memory_bytes_per_s": f"4.8 TB/s HBM3e, {_H100_H200_SHEET}",
         "bf16_flops": f"1,979 TFLOPS with sparsity / 2, {_H100_H200_SHEET}",
         "fp8_flops": f"3,958 TFLOPS with sparsity / 2, {_H100_H200_SHEET}",
         "memory_bytes": f"141 GB, {_H100_H200_SHEET}",
         "link_bytes_per_s": f"NVLink 4 900 GB/s bidirectional / 2, {_H100_H200_SHEET}",
         "link_latency_s": ASSUMED_LATENCY,
         "launch_s": ASSUMED_LAUNCH}),
    "b200": Hardware(
        "b200", 8.0 * T, 2250 * T, 4500 * T, 180 * G, 900 * G, 3e-6, None,
        {"memory_bytes_per_s": f"8 TB/s HBM3e, {_HGX_B}",
         "bf16_flops": f"2.25 PFLOPS dense (HGX, 1,000 W), {_KLOCKWOOD_B}",
         "fp8_flops": f"4.5 PFLOPS dense (HGX), {_KLOCKWOOD_B}",
         "memory_bytes": f"1,440 GB per 8-GPU HGX B200 / 8, {_HGX_B}",
         "link_bytes_per_s": f"NVLink 5 1.8 TB/s bidirectional / 2, {_HGX_B}",
         "link_latency_s": ASSUMED_LATENCY, "launch_s": ASSUMED_LAUNCH}),
    "b300": Hardware(
        "b300", 8.0 * T, 2250 * T, 4500 * T, 288 * G, 900 * G, 3e-6, None,
        {"memory_bytes_per_s": f"8 TB/s HBM3e, {_HGX_B}",
         "bf16_flops": f"2.25 PFLOPS dense (HGX B300, as B200), {_KLOCKWOOD_B}",
         "fp8_flops": f"4.5 PFLOPS dense (HGX B300), {_KLOCKWOOD_B}",
         "memory_bytes": f"288 GB HBM3e, {_HGX_B}",
         "link_bytes_per_s": f"NVLink 5 1.8 TB/s bidirectional / 2, {_HGX_B}",
         "link_latency_s": ASSUMED_LATENCY, "launch_s": ASSUMED_LAUNCH}),
    "mi300x": Hardware(
        "mi300x", 5.3 * T, 1307.4 * T, 2614.9 * T, 192 * G, 448 * G, 3e-6, None,
        {"memory_bytes_per_s": "5.3 TB/s HBM3, AMD Instinct MI300X datasheet, "
                               "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html",
         "bf16_flops": "1,307.4 TFLOPS dense, AMD Instinct MI300X datasheet",
         "fp8_flops": "2,614.9 TFLOPS dense, AMD Instinct MI300X datasheet",
         "memory_bytes": "192 GB HBM3, AMD Instinct MI300X datasheet",
         "link_bytes_per_s": "Infinity Fabric 7 links x 64 GB/s per direction, AMD Instinct MI300X datasheet "
                             "(896 GB/s aggregate bidirectional)",
         "link_latency_s": ASSUMED_LATENCY, "launch_s": ASSUMED_LAUNCH}),
    "mi355x": Hardware(
        "mi355x", 8.0 * T, 2516.6 * T, 5033.2 * T, 288 * G, 537.6 * G, 3e-6, None,
        {"memory_bytes_per_s": "8 TB/s HBM3E, AMD Instinct MI355X datasheet, "
                               "https://www.amd.com/en/products/accelerators/instinct/mi350/mi355x.html",
         "bf16_flops": "2.5 PFLOPS dense (2,516.6 TFLOPS), AMD Instinct MI355X datasheet",
         "fp8_flops": "5.0 PFLOPS dense (5,033.2 TFLOPS), AMD Instinct MI355X datasheet",
         "memory_bytes": "288 GB HBM3E, AMD Instinct MI355X datasheet",
         "link_bytes_per_s": "Infinity Fabric 7 links x 153.6 GB/s bidirectional / 2, AMD Instinct MI355X "
                             "datasheet",
         "link_latency_s": ASSUMED_LATENCY, "launch_s": ASSUMED_LAUNCH}),
}


def named(name: str) -> Hardware:
    """--hardware NAME from the table (one line naming the known ones otherwise)."""
    try:
        return TABLE[name.lower()]
    except KeyError:
        raise UserError(f"--hardware {name!r}: unknown; known: {', '.join(TABLE)} "
                        "(or --hardware-file FILE.json)") from None


def from_file(path: Path) -> Hardware:
    """--hardware-file: one JSON object in the SCHEMA above."""
    raw = read_json(path, "--hardware-file", f"; expected {SCHEMA}")
    if not isinstance(raw, dict):
        raise UserError(f"--hardware-file {path}: expected one JSON object: {SCHEMA}")
    unknown = set(raw) - {f.name for f in fields(Hardware)}
    missing = [k for k in NUMERIC if k not in raw]
    if unknown or missing:
        what = (f"missing {', '.join(missing)}" if missing else "") + ("; " if missing and unknown else "") + \
               (f"unknown {', '.join(sorted(unknown))}" if unknown else "")
        raise UserError(f"--hardware-file {path}: {what}; expected {SCHEMA}")
    for k in NUMERIC + (("launch_s",) if "launch_s" in raw else ()):
        v = raw[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise UserError(f"--hardware-file {path}: {k} must be a number > 0, got {v!r}")
    sources = raw.get("sources", {})
    if not isinstance(sources, dict):
        raise UserError(f"--hardware-file {path}: sources must be an object (field -> text)")
    launch = float(raw["launch_s"]) if "launch_s" in raw else None
    return Hardware(str(raw.get("name", Path(path).stem)), *(float(raw[k]) for k in NUMERIC), launch,
                    sources={k: str(v) for k, v in sources.items()})
