"""`--tp N`: a command starts its own N ranks (no external launcher), or runs as one rank of torchrun.

Each rank is a spawned process running the same function over the command's config (run); the
model inside is this rank's shard (parallel.py) and every rank runs the same loop in lockstep, so
the collectives line up. Rank 0 prints; the other ranks' stdout/stderr go to /dev/null.

Errors: inputs are validated before spawning (flags, --tp against the model's sizes, GPUs
available). A UserError on any rank is sent to the parent, which prints it as the usual one line
and exits non-zero; when one rank dies the others are terminated (no rank waits forever in a
collective), and the process group has a timeout (GLM5MTP_TP_TIMEOUT_S, default 600) as a second
guard. Ctrl-C terminates every rank. NCCL runs with NCCL_NVLS_ENABLE=0 (NVLink multicast off) and
its communicator created at init (the engine captures collectives into CUDA graphs).
"""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta

import torch
import typer

from glm5mtp_cli.errors import UserError
from glm5mtp_cli.core.parallel import Comm, check_tp

_COMM: Comm | None = None  # set inside a rank
TIMEOUT_ENV = "GLM5MTP_TP_TIMEOUT_S"


def _timeout() -> timedelta:
    try:
        return timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, "600")))
    except ValueError:
        raise UserError(f"{TIMEOUT_ENV} must be a number of seconds") from None


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1


def _wants_cuda(device: str) -> bool:
    if device == "auto":
        return torch.cuda.is_available()
    return device.startswith("cuda")


def _backend(device: str) -> str:
    return "nccl" if _wants_cuda(device) else "gloo"


def precheck(tp: int, model: str, device: str) -> None:
    """Everything that can be refused before a rank starts: one line, no processes left behind."""
    from glm5mtp_cli.checkpoint.resolve import resolve_config

    cfg, _ = resolve_config(model)
    check_tp(cfg, tp)
    if _wants_cuda(device):
        if not torch.cuda.is_available():
            raise UserError(f"--device {device}: CUDA is not available on this machine")
        if device not in ("auto", "cuda"):
            raise UserError(f"--tp {tp} on CUDA puts rank r on cuda:r: give --device cuda or auto, not {device}")
        n = torch.cuda.device_count()
        if tp > n:
            raise UserError(f"--tp {tp} needs {tp} GPUs (one per rank); this machine has {n}")


def run(spec, fn, arg) -> None:
    """fn(arg) here, or on spec.tp spawned ranks when needed (tp > 1, not already a rank, not under
    torchrun): `arg` is the command's whole config (it pickles), `fn` a module-level function."""
    if _COMM is not None or under_torchrun() or spec.tp == 1:
        fn(arg)
        return
    precheck(spec.tp, spec.name, spec.device)
    spawn(spec.tp, _backend(spec.device), fn, arg)


def rank_comm(tp: int, device: str) -> Comm | None:
    """This process's Comm: the spawned rank's, torchrun's (initialised here), or None for one device."""
    global _COMM
    if _COMM is not None:
        return _COMM
    if not under_torchrun():
        return None
    world = int(os.environ["WORLD_SIZE"])
    if tp not in (1, world):  # tp 1 (the default) under torchrun: take its world size
        raise UserError(f"--tp {tp} but torchrun started WORLD_SIZE={world} ranks")
    rank = int(os.environ["RANK"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    backend = _backend(device)
    if backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(local)
    if rank != 0:
        _silence()
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=_timeout(), device_id=_eager_device(backend, local))
    _COMM = Comm(rank, world, None, local)
    return _COMM


def _eager_device(backend: str, local: int) -> torch.device | None:
    """NCCL: the rank's GPU, so init_process_group creates the communicator now rather than at the
    first collective, which may be inside a CUDA-graph capture, where it cannot be created
    (parallel.Comm)."""
    return torch.device("cuda", local) if backend == "nccl" else None


def _silence() -> None:
    devnull = open(os.devnull, "w")
    sys.stdout = devnull
    sys.stderr = devnull


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(tp: int, backend: str, fn, arg) -> None:
    """Run fn(arg) on tp spawned ranks; wait for all. Raises UserError (a rank's), typer.Exit
    (a rank's non-zero exit code) or KeyboardInterrupt after terminating every rank."""
    import typer
    import logging

    import torch.multiprocessing as mp

    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # our own line says it
    if backend == "nccl":
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # inherited by the ranks
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    pc = mp.start_processes(_rank_main, args=(tp, port, backend, fn, arg, errors, _timeout().total_seconds()),
                            nprocs=tp, join=False, start_method="spawn")
    try:
        while not pc.join():
            pass
    except KeyboardInterrupt:
        _terminate(pc)
        raise
    except mp.ProcessExitedException as e:
        _terminate(pc)
        if not errors.empty():
            raise UserError(errors.get()) from None
        if e.exit_code is not None and e.exit_code > 0:
            raise typer.Exit(e.exit_code) from None
        raise RuntimeError(f"--tp {tp}: rank {e.error_index} died ({e})") from None
    except mp.ProcessRaisedException as e:
        _terminate(pc)
        raise RuntimeError(f"--tp {tp}: rank {e.error_index} failed:\n{e}") from None


def _terminate(pc) -> None:
    for p in pc.processes:
        if p.is_alive():
            p.terminate()
    for p in pc.processes:
        p.join(10)
        if p.is_alive():
            p.kill()


def _rank_main(rank: int, world: int, port: int, backend: str, fn, arg, errors, timeout_s: float) -> None:
    global _COMM
    import torch.distributed as dist

    if backend == "gloo":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    else:
        torch.cuda.set_device(rank)
    if rank != 0:
        _silence()
    # Imported before the group exists: torch.distributed.nn.functional's functions take group.WORLD
    # as a default argument, so imported later (torch._dynamo imports it lazily, at a model's first
    # build) they hold the group, destroy_process_group cannot free it, and its gloo threads and
    # sockets lived on into the interpreter's teardown while the peer rank exited
    import torch.distributed.nn as _  # noqa: F401

    code = 0
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s), device_id=_eager_device(backend, rank))
        _COMM = Comm(rank, world, None, rank)
        fn(arg)
        dist.barrier(device_ids=[rank]) if backend == "nccl" else dist.barrier()
        dist.destroy_process_group()
    except UserError as e:
        errors.put(str(e))
        code = e.exit_code
    except typer.Exit as e:
        code = e.exit_code
    except KeyboardInterrupt:
        code = 130
    if code:
        sys.stdout.flush()
        os._exit(code)  # skip destroying a process group whose peers may be mid-collective
