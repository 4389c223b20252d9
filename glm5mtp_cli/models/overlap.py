"""Two independent branches of a forward at once: the second on a side stream that the current one
forks to and joins. For branches of small, latency-bound kernels that leave most of the GPU idle
(MoE's shared expert beside the router and the routed experts of a decode step); a CUDA-graph
capture records them as parallel branches, so every replay overlaps them too.

Elsewhere the branches run one after the other: on the CPU, inside torch.compile (which traces a
single stream) and with autograd recording (training).
"""

from __future__ import annotations

from typing import Callable

import torch

_SIDE: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device)
    return _SIDE[device]


def side_by_side(main: Callable[[], torch.Tensor], side: Callable[[], torch.Tensor], x: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(main(), side()) with side() on the side stream of x's device while main() runs here."""
    if not x.is_cuda or torch.is_grad_enabled() or torch.compiler.is_compiling():
        return main(), side()
    here = torch.cuda.current_stream(x.device)
    stream = _side_stream(x.device)
    stream.wait_stream(here)
    with torch.cuda.stream(stream):
        b = side()
    a = main()
    here.wait_stream(stream)
    b.record_stream(here)  # freed here later: the allocator must not hand its memory to the side stream before
    return a, b
