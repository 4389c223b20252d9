"""Every Triton kernel launch the kernel tests make, compiled for the H200 (sm_90) on this CPU.

The interpreter (tests/test_kernels.py) runs a kernel's Python, not Triton's compiler: it takes
code that the compiler refuses (a device run was once lost to a kernel that ran in the interpreter
and failed the compiler's checks of its `return`s), and it never takes the GPU's branches (bf16
`tl.dot`: a bf16 x fp16 dot there fails here, not in the interpreter). Here each case of
tests/test_kernels.py, tests/test_kernels_next.py, tests/test_kernels_paged.py and tests/test_moe_grouped.py runs once with every
launch caught instead of run (its argument types and compile-time constants recorded, as the GPU
would specialize them, the GPU's branches included), and each distinct launch goes through Triton's
NVIDIA front end and optimizer to LLVM IR. No GPU, no CUDA driver, no ptxas is needed.
"""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from kernels import _triton  # noqa: E402

pytestmark = [pytest.mark.compile,  # Triton's compiler for every launch: the second test command
              pytest.mark.skipif(not _triton.HAVE_TRITON or _triton.interpreting(),
                                 reason="needs triton, not in interpreter mode")]

TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8e4nv",
         torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
         torch.bool: "i1"}


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def _launch_key(fn, args, kwargs):
    """(fn, signature, constants, num_warps, num_stages) of one launch, hashable."""
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    values = dict(zip(fn.arg_names, args), **kwargs)
    signature, constants = {}, {}
    for p in fn.params:
        v = values[p.name]
        if p.is_constexpr:
            constants[p.name] = v
        else:
            signature[p.name] = _arg_type(v)
    return (fn, tuple(signature.items()), tuple(constants.items()),
            options.get("num_warps", 4), options.get("num_stages", 3))


def _kernel_modules():
    import importlib
    import pkgutil

    import kernels

    return [importlib.import_module(f"kernels.{info.name}") for info in pkgutil.iter_modules(kernels.__path__)]


def _caught_launches() -> list[tuple]:
    """Every distinct launch of the four files' cases at their small (CPU) shapes."""
    import test_kernels
    import test_kernels_next
    import test_kernels_paged
    import test_moe_grouped
    from triton.runtime.jit import JITFunction

    launches: dict[tuple, None] = {}

    def catch(self, *args, grid, warmup, **kwargs):
        launches[_launch_key(self, args, dict(kwargs))] = None

    mp = pytest.MonkeyPatch()
    mp.setattr(JITFunction, "run", catch)
    for mod in _kernel_modules():  # each dispatcher takes its Triton branch for CPU tensors
        if hasattr(mod, "use_triton"):
            mp.setattr(mod, "use_triton", lambda *tensors, force=False: True)
    try:
        for cases in (test_kernels.CASES, test_kernels_next.CASES, test_kernels_paged.CASES, test_moe_grouped.CASES):
            for name, case in cases.items():
                torch.manual_seed(zlib.crc32(name.encode()))
                try:
                    case("cpu", False)
                except Exception:  # outputs are never written: a case's own checks on them may fail
                    pass
    finally:
        mp.undo()
    return list(launches)


def _compile(fn, signature: dict, constants: dict, num_warps: int, num_stages: int) -> str:
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    options = backend.parse_options({"num_warps": num_warps, "num_stages": num_stages})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    source = ASTSource(fn, signature, constants)
    module = source.make_ir(backend.target, options, backend.get_codegen_implementation(options),
                            backend.get_module_map(), context)
    stages: dict = {}
    backend.add_stages(stages, options, source.language)
    metadata: dict = {}
    for name, stage in stages.items():
        module = stage(module, metadata)
        if name == "llir":
            return module
    raise AssertionError("the NVIDIA backend has no llir stage")


@pytest.fixture(scope="module")
def launches():
    pytest.importorskip("triton.backends.nvidia.compiler")
    return _caught_launches()


def test_every_kernel_is_launched(launches):
    """The cases reach every @jit kernel of kernels/ (a new kernel comes with a case)."""
    from triton.runtime.jit import JITFunction

    defined = {f"{mod.__name__}.{n}" for mod in _kernel_modules() for n, v in vars(mod).items()
               if isinstance(v, JITFunction) and n.endswith("_kernel") and v.__module__ == mod.__name__}
    launched = {f"{fn.__module__}.{fn.__name__}" for fn, *_ in launches}
    assert defined and defined <= launched, sorted(defined - launched)


def test_every_launch_compiles_for_sm90(launches):
    failed = []
    for fn, signature, constants, num_warps, num_stages in launches:
        try:
            assert "define" in _compile(fn, dict(signature), dict(constants), num_warps, num_stages)
        except Exception as exc:
            failed.append(f"{fn.__module__}.{fn.__name__} {dict(constants)}: {type(exc).__name__}: {str(exc)[:300]}")
    assert not failed, "\n".join(failed)
