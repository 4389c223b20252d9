"""How many GPU kernels one decode (and one 4-row verify) forward of a model launches: what each
CUDA-graph replay of that step still pays for, a few microseconds apiece.

    python -m glm5mtp_cli.diagnostics.kernel_count [MODEL]        (CUDA only; default glm5-nano)
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from glm5mtp_cli.engine.config import DEFAULT_MODEL, ModelSpec
from glm5mtp_cli.engine.runtime import load_runtime


def count_kernels(model: str = DEFAULT_MODEL, context: int = 100) -> dict[str, int]:
    rt = load_runtime(ModelSpec(model, "cuda", "bf16"), with_mtp=False, progress=False)
    pools = rt.make_pools(context + 16, 1)
    cache = pools.target_cache()
    cache.reserve(context + 8)
    out = {}
    with torch.no_grad():
        rt.target(torch.randint(0, rt.cfg.vocab_size, (1, context), device="cuda"), [cache])
        for rows, name in ((1, "decode"), (4, "verify_4_rows")):
            x = torch.randint(0, rt.cfg.vocab_size, (1, rows), device="cuda")
            rt.target(x, [cache])  # warm-up (Triton compiles)
            cache.truncate(context)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                rt.target(x, [cache])
                torch.cuda.synchronize()
            cache.truncate(context)
            out[name] = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    cache.release()
    out["layers"] = rt.cfg.num_hidden_layers
    return out


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("kernel_count needs CUDA")
    print(count_kernels(*(sys.argv[1:2] or [DEFAULT_MODEL])))
