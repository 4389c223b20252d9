"""The memory check before loading: one line when the predicted bytes do not fit, before any weight
is read; the cgroup and MemAvailable readers on sample files; the FP8-on-the-CPU note; --tp's limit."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

import glm5mtp_cli.engine.memory_check as memory_check
import glm5mtp_cli.engine.runtime as runtime
from glm5mtp_cli.checkpoint.resolve import resolve_config
from glm5mtp_cli.cli import app
from glm5mtp_cli.diagnostics.sizing import predicted_weight_bytes, resident_bytes
from glm5mtp_cli.engine.config import ModelSpec
from glm5mtp_cli.core.parallel import check_tp
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.units import fmt_bytes

GIB = 2**30
CPU = torch.device("cpu")


def _room(nbytes: int, source: str = "MemAvailable"):
    return lambda root=None: (nbytes, source)


@pytest.mark.parametrize("cmd", [["generate", "--prompt-ids", "1,2"], ["leak-check"], ["bench"],
                                 ["profile", "--max-seq-len", "64"], ["acceptance", "--limit", "1"]])
def test_refused_in_one_line_before_any_weight_is_read(cmd, monkeypatch):
    monkeypatch.setattr(memory_check, "host_available", _room(1 << 20))
    monkeypatch.setattr(runtime, "load_models", lambda *a, **k: pytest.fail("weights loaded"))
    r = CliRunner().invoke(app, [*cmd, "--model", "glm5-nano", "--device", "cpu"])
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert lines[0].startswith("error: glm5-nano with 4 target layers needs ") and "(MemAvailable)" in lines[0]


def test_bench_random_weights_is_refused_before_building_them(monkeypatch):
    from glm5mtp_cli.diagnostics import step_bench

    monkeypatch.setattr(memory_check, "host_available", _room(1 << 20))
    monkeypatch.setattr(step_bench, "random_drafter", lambda *a, **k: pytest.fail("weights built"))
    r = CliRunner().invoke(app, ["bench", "--model", "glm5-nano", "--random-weights", "--device", "cpu"])
    assert r.exit_code == 2 and "needs " in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output


def test_the_numbers_are_sizings_prediction(monkeypatch):
    cfg, _ = resolve_config("glm5next-nano")
    need = resident_bytes(cfg, torch.float32, "cpu", True)
    assert need["weights"] == predicted_weight_bytes(cfg, torch.float32)
    bf16 = resident_bytes(cfg, torch.bfloat16, "cpu", True)["total"]
    # room for bf16 (and its margin), not for fp32
    have = memory_check.with_margin(bf16)
    assert memory_check.with_margin(need["total"]) > have
    monkeypatch.setattr(memory_check, "host_available", _room(have, "cgroup memory.max"))
    with pytest.raises(UserError) as e:
        memory_check.check_memory("glm5next-nano", cfg, torch.float32, CPU, with_mtp=True)
    msg = str(e.value)
    assert (f"needs {fmt_bytes(need['total'], 1)} resident in fp32 (weights {fmt_bytes(need['weights'], 1)}, state "
            f"{fmt_bytes(need['state'], 1)}, scratch {fmt_bytes(need['scratch'], 1)}) + a 5% + 0.25 GiB margin; "
            f"this process may use {fmt_bytes(have, 1)} (cgroup memory.max): try --dtype bf16 "
            f"({fmt_bytes(bf16, 1)})") in msg, msg


def test_fewer_layers_are_offered_when_no_dtype_fits(monkeypatch):
    cfg, _ = resolve_config("glm5-nano")
    one = resident_bytes(cfg.with_layers(1), torch.bfloat16, "cpu", True)["total"]
    monkeypatch.setattr(memory_check, "host_available", _room(memory_check.with_margin(one)))
    with pytest.raises(UserError, match=rf"try --dtype bf16 --layers 1 \({fmt_bytes(one, 1)}\)$"):
        memory_check.check_memory("glm5-nano", cfg, torch.float32, CPU, with_mtp=True)
    monkeypatch.setattr(memory_check, "host_available", _room(one // 2))
    with pytest.raises(UserError, match="nothing fits: even --layers 1 --dtype bf16 needs"):
        memory_check.check_memory("glm5-nano", cfg, torch.float32, CPU, with_mtp=True)


def test_ranks_sharing_the_host_count_together(monkeypatch):
    cfg, _ = resolve_config("glm5-nano")
    share = resident_bytes(cfg, torch.float32, "cpu", True, tp=2)
    assert share["weights"] < predicted_weight_bytes(cfg, torch.float32)
    # one rank's share fits, two of them do not
    monkeypatch.setattr(memory_check, "host_available", _room(memory_check.with_margin(share["total"])))
    memory_check.check_memory("glm5-nano", cfg, torch.float32, CPU, True, tp=2, ranks=1)
    with pytest.raises(UserError, match=rf"the 2 ranks of glm5-nano with 4 target layers under --tp 2 need "
                                        rf"{fmt_bytes(2 * share['total'], 1)} "):
        memory_check.check_memory("glm5-nano", cfg, torch.float32, CPU, True, tp=2, ranks=2)


def test_cuda_counts_free_memory_and_this_process_cache(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (3 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev: 2 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev: GIB)
    assert memory_check.available(torch.device("cuda", 1)) == (4 * GIB, "free on cuda:1")


@pytest.mark.parametrize("name", ["glm5-nano", "glm5next-nano"])
def test_shipped_nano_models_fit_here(name):
    cfg, _ = resolve_config(name)
    assert memory_check.host_available() is not None  # this test machine is Linux: something says
    memory_check.check_memory(name, cfg, torch.float32, CPU, with_mtp=True)


# ---- the readers, on sample files ------------------------------------------------------------------

def _write(root, files: dict[str, str]):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


MEMINFO = "MemTotal:       32000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20971520 kB\n"  # 20 GiB


def test_meminfo_without_a_cgroup_limit(tmp_path):
    _write(tmp_path, {"proc/meminfo": MEMINFO, "proc/self/cgroup": "0::/job\n",
                      "sys/fs/cgroup/job/memory.max": "max\n", "sys/fs/cgroup/job/memory.current": "123\n"})
    assert memory_check.host_available(tmp_path) == (20 * GIB, "MemAvailable")


def test_cgroup_v2_limit_minus_usage_with_reclaimable_cache(tmp_path):
    _write(tmp_path, {"proc/meminfo": MEMINFO, "proc/self/cgroup": "0::/user.slice/job\n",
                      "sys/fs/cgroup/user.slice/job/memory.max": f"{8 * GIB}\n",
                      "sys/fs/cgroup/user.slice/job/memory.current": f"{3 * GIB}\n",
                      "sys/fs/cgroup/user.slice/job/memory.stat": f"anon 100\ninactive_file {GIB}\nactive_file 7\n"})
    assert memory_check.host_available(tmp_path) == (6 * GIB, "cgroup memory.max")


def test_a_parent_cgroup_tighter_than_the_own_binds(tmp_path):
    _write(tmp_path, {"proc/meminfo": MEMINFO, "proc/self/cgroup": "0::/user.slice/job\n",
                      "sys/fs/cgroup/user.slice/memory.max": f"{4 * GIB}\n",
                      "sys/fs/cgroup/user.slice/memory.current": f"{3 * GIB}\n",
                      "sys/fs/cgroup/user.slice/job/memory.max": "max\n",
                      "sys/fs/cgroup/user.slice/job/memory.current": "5\n"})
    assert memory_check.host_available(tmp_path) == (GIB, "cgroup memory.max")


def test_cgroup_v1_and_its_unlimited_value(tmp_path):
    base = {"proc/meminfo": MEMINFO, "proc/self/cgroup": "5:cpu,cpuacct:/x\n4:memory:/docker/abc\n0::/\n",
            "sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes": f"{2 * GIB}\n",
            "sys/fs/cgroup/memory/docker/abc/memory.stat": f"inactive_file 9\ntotal_inactive_file {GIB}\n"}
    _write(tmp_path, {**base, "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": f"{5 * GIB}\n"})
    assert memory_check.host_available(tmp_path) == (4 * GIB, "cgroup memory.limit_in_bytes")
    _write(tmp_path, {"sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": "9223372036854771712\n"})
    assert memory_check.host_available(tmp_path) == (20 * GIB, "MemAvailable")


def test_a_cgroup_namespace_reads_the_mount_root(tmp_path):
    """Inside a container the listed path need not exist under the mount: the mount is the cgroup."""
    _write(tmp_path, {"proc/meminfo": MEMINFO, "proc/self/cgroup": "0::/kubepods/pod1/c1\n",
                      "sys/fs/cgroup/memory.max": f"{2 * GIB}\n", "sys/fs/cgroup/memory.current": "0\n"})
    assert memory_check.host_available(tmp_path) == (2 * GIB, "cgroup memory.max")


def test_a_limit_above_what_the_host_has_leaves_meminfo(tmp_path):
    _write(tmp_path, {"proc/meminfo": MEMINFO, "proc/self/cgroup": "0::/\n",
                      "sys/fs/cgroup/memory.max": f"{64 * GIB}\n", "sys/fs/cgroup/memory.current": "0\n"})
    assert memory_check.host_available(tmp_path) == (20 * GIB, "MemAvailable")


def test_nothing_to_read_skips_the_check(tmp_path, monkeypatch):
    assert memory_check.host_available(tmp_path) is None
    monkeypatch.setattr(memory_check, "host_available", lambda root=None: None)
    cfg, _ = resolve_config("glm5")
    memory_check.check_memory("glm5", cfg, torch.float32, CPU, with_mtp=True)


# ---- the FP8 note and --tp's limit -----------------------------------------------------------------

class _Stop(Exception):
    pass


def test_fp8_on_the_cpu_is_noted_once(monkeypatch, capsys):
    def stop(*a, **k):
        raise _Stop

    monkeypatch.setattr(runtime, "load_models", stop)
    runtime.note_fp8_on_cpu.cache_clear()
    for fp8 in (False, True, True):
        with pytest.raises(_Stop):
            runtime.load_runtime(ModelSpec("glm5-nano", "cpu", "fp32", random_weights=True, fp8=fp8), progress=False)
        if not fp8:
            assert "FP8" not in capsys.readouterr().err
    assert capsys.readouterr().err.count("note: FP8 weights on the CPU") == 1
    runtime.note_fp8_on_cpu.cache_clear()


def test_tp_names_every_size_and_the_ranks_that_work():
    cfg, _ = resolve_config("glm5-nano")
    with pytest.raises(UserError) as e:
        check_tp(cfg, 64)
    assert str(e.value) == ("--tp 64 does not divide the model's num_attention_heads (6): each rank takes an equal "
                            "share of num_attention_heads 6, n_routed_experts 16, intermediate_size (dense MLP) 1024, "
                            "moe_intermediate_size x n_shared_experts 112, so --tp can be 1 or 2")
    next_cfg, _ = resolve_config("glm5next")
    with pytest.raises(UserError, match=r"n_routed_experts \(288\): .*, so --tp can be 1, 2, 4, 8, 16 or 32$"):
        check_tp(next_cfg, 64)
