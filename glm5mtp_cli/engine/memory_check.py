"""Before a command reads any weight: does what it will hold fit in the memory this process may have?

What it will hold is sizing.resident_bytes, from the config alone: the weights as this rank will
hold them (FP8 kept FP8), a first sequence's pools and one forward's scratch. What it may have is,
on CUDA, the device's free memory; on the CPU, the tightest cgroup limit over this process's
cgroup and its parents, or MemAvailable when no limit is set or the host has less. Too big is one
line with both numbers and what would fit (--dtype bf16, fewer --layers), at once: unchecked,
GLM-5-Next with one layer at fp32 ran 68 s on a 24 GB machine before the kernel killed it.

The margin covers what the prediction leaves out: loading GLM-5 and GLM-5-Next (one layer, FP8,
random weights, on the CPU of an H200 host) peaked 0.20-0.31 GiB above the predicted weights and
what the process held before (modules imported while loading, allocator slack).
"""

from __future__ import annotations

from pathlib import Path

import torch

from glm5mtp_cli.diagnostics.sizing import resident_bytes
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.core.dtypes import dtype_bytes
from glm5mtp_cli.units import fmt_bytes

MARGIN_FRACTION = 0.05
MARGIN_BYTES = 256 << 20
MARGIN_TEXT = "5% + 0.25 GiB"
_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# cgroup v1 writes "no limit" as LONG_MAX rounded down to a page; v2 writes "max"
_UNLIMITED = 1 << 62
# (limit file, usage file, memory.stat key of the page cache the kernel reclaims before it kills)
_V2 = ("memory.max", "memory.current", "inactive_file")
_V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")


def check_memory(name: str, cfg, dtype: torch.dtype, device: torch.device, with_mtp: bool,
                 tp: int = 1, ranks: int = 1) -> None:
    """One UserError line when the predicted bytes of loading cfg (this rank's share under --tp,
    times `ranks` when that many ranks share this memory) and the margin exceed what this process
    may have. name: the model as the user gave it."""
    room = available(device)
    if room is None:
        return
    have, source = room
    need = {k: v * ranks for k, v in resident_bytes(cfg, dtype, device.type, with_mtp, tp).items()}
    if with_margin(need["total"]) <= have:
        return
    layers = cfg.num_hidden_layers
    who = f"{name} with {layers} target layer{'s' if layers != 1 else ''}"
    if tp > 1:
        who = ("one rank" if ranks == 1 else f"the {ranks} ranks") + f" of {who} under --tp {tp}"
    verb = "need" if ranks > 1 else "needs"
    raise UserError(f"{who} {verb} {_gib(need['total'])} resident in {_NAMES.get(dtype, dtype)} (weights "
                    f"{_gib(need['weights'])}, state {_gib(need['state'])}, scratch {_gib(need['scratch'])}) "
                    f"+ a {MARGIN_TEXT} margin; this process may use {_gib(have)} ({source}): "
                    + _what_fits(cfg, dtype, device.type, with_mtp, tp, ranks, have))


def with_margin(nbytes: int) -> int:
    return int(nbytes * (1 + MARGIN_FRACTION)) + MARGIN_BYTES


def _gib(nbytes: int) -> str:
    return fmt_bytes(nbytes, 1)


def _what_fits(cfg, dtype, device_type: str, with_mtp: bool, tp: int, ranks: int, have: int) -> str:
    """'try ...' with the changes of --dtype and --layers that fit (each with its need, as the
    headline's: before the margin), or what even the smallest needs."""
    def need(c, dt) -> int:
        return resident_bytes(c, dt, device_type, with_mtp, tp)["total"] * ranks

    def fits(c, dt) -> bool:
        return with_margin(need(c, dt)) <= have

    bf16 = torch.bfloat16
    narrower = dtype_bytes(dtype) > 2  # bf16 is there to offer
    tries = []
    if narrower and fits(cfg, bf16):
        tries.append(f"--dtype bf16 ({_gib(need(cfg, bf16))})")
    k = _most_layers(cfg, lambda c: fits(c, dtype))
    if k is not None:
        tries.append(f"--layers {k} ({_gib(need(cfg.with_layers(k), dtype))})")
    elif narrower and not tries:
        k = _most_layers(cfg, lambda c: fits(c, bf16))
        if k is not None:
            tries.append(f"--dtype bf16 --layers {k} ({_gib(need(cfg.with_layers(k), bf16))})")
    if tries:
        return "try " + " or ".join(tries)
    smallest = [flag for flag, smaller in (("--layers 1", cfg.num_hidden_layers > 1), ("--dtype bf16", narrower))
                if smaller]
    if not smallest:
        return f"it is already 1 layer in {_NAMES.get(dtype, dtype)}, nothing smaller to try"
    return f"nothing fits: even {' '.join(smallest)} needs {_gib(need(cfg.with_layers(1), bf16 if narrower else dtype))}"


def _most_layers(cfg, fits) -> int | None:
    """The most target layers, fewer than cfg's, for which fits(cfg.with_layers(k)); None if not even
    one. Bisected: the bytes only grow with the layers."""
    lo, hi = 0, cfg.num_hidden_layers - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(cfg.with_layers(mid)):
            lo = mid
        else:
            hi = mid - 1
    return lo or None


# ---- what this process may have -------------------------------------------------------------------

def available(device: torch.device) -> tuple[int, str] | None:
    """(bytes this process may still allocate on `device`, where that number comes from), or None
    when nothing says."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        # blocks this process's caching allocator holds unused are free to it as well
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free + cached, f"free on {device}"
    return host_available()


def host_available(root: Path = Path("/")) -> tuple[int, str] | None:
    """The host's side of `available`: a cgroup's limit minus its usage, the tightest over this
    process's cgroup and its parents, when one is set and below MemAvailable; else MemAvailable.
    root: where /proc and /sys are (tests point it at sample files)."""
    mem = _meminfo_available(root)
    cgroup = _cgroup_headroom(root)
    if cgroup is not None and (mem is None or cgroup[0] < mem[0]):
        return cgroup
    return mem


def _meminfo_available(root: Path) -> tuple[int, str] | None:
    try:
        lines = (root / "proc/meminfo").read_text().splitlines()
    except OSError:  # not Linux
        return None
    for line in lines:
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024, "MemAvailable"
    return None


def _cgroup_headroom(root: Path) -> tuple[int, str] | None:
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    best = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: mounted alone, or beside v1 as "unified"
            mounts, files = ("sys/fs/cgroup", "sys/fs/cgroup/unified"), _V2
        elif "memory" in controllers.split(","):
            mounts, files = ("sys/fs/cgroup/memory",), _V1
        else:
            continue
        for mount in mounts:
            for folder in _up_from(root / mount, path):
                room = _headroom(folder, *files)
                if room is not None and (best is None or room < best[0]):
                    best = (room, f"cgroup {files[0]}")
    return best


def _up_from(mount: Path, path: str) -> list[Path]:
    """The cgroup's folder under its mount and each parent up to the mount; the mount alone when the
    folder is not there (a cgroup namespace mounts the process's own cgroup as the root)."""
    folder = mount / path.strip("/")
    if not folder.is_dir():
        return [mount]
    out = [folder]
    while folder != mount:
        folder = folder.parent
        out.append(folder)
    return out


def _headroom(folder: Path, limit_file: str, usage_file: str, cache_key: str) -> int | None:
    """The cgroup's limit minus its usage, its reclaimable page cache counted as free; None without
    a limit."""
    try:
        limit = (folder / limit_file).read_text().strip()
        usage = int((folder / usage_file).read_text())
    except (OSError, ValueError):
        return None
    if limit == "max" or int(limit) >= _UNLIMITED:
        return None
    cache = 0
    try:
        for line in (folder / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == cache_key:
                cache = int(value)
    except OSError:
        pass
    return max(0, int(limit) - usage + cache)
