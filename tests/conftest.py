"""Shared fixtures: checkpoints written by transformers (the oracle) with MTP weights added."""

from __future__ import annotations

import pytest
import torch

# One thread: small decode matrices gain nothing from a second one on a 2-core machine, and lose much
# when the other core is busy.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def hf_ckpt(tmp_path_factory):
    """(folder, transformers model): random glm5-tiny target at full strength, random MTP layer."""
    from oracle import hf_model, write_with_mtp

    model = hf_model(seed=0)
    folder = write_with_mtp(model, tmp_path_factory.mktemp("hf_ckpt"), mtp_seed=1)
    return folder, model


@pytest.fixture(scope="session")
def spec_ckpt(tmp_path_factory):
    """(folder, transformers model): a near-bigram target and an MTP layer that mostly predicts it,
    so verify steps accept some drafts and reject others."""
    from oracle import hf_model, write_with_mtp

    model = hf_model(seed=2, output_scale=0.02)
    folder = write_with_mtp(model, tmp_path_factory.mktemp("spec_ckpt"), mtp_seed=3, mirror=0.03)
    return folder, model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random-weight glm5-tiny checkpoint written by init-random (fp32), as a folder path."""
    from glm5mtp_cli.checkpoint.write import init_random

    out = tmp_path_factory.mktemp("tiny")
    init_random("glm5-tiny", out, seed=1, dtype=torch.float32)
    return str(out)


@pytest.fixture(scope="session")
def spec_runtime(spec_ckpt):
    """glm5mtp's own target and MTP layer of spec_ckpt, loaded once on the CPU in fp32 (read-only)."""
    from glm5mtp_cli.checkpoint.load import load_models
    from glm5mtp_cli.checkpoint.resolve import resolve_model
    from glm5mtp_cli.engine.runtime import Runtime

    folder, _ = spec_ckpt
    resolved = resolve_model(str(folder), progress=False)
    target, mtp, _ = load_models(resolved, "cpu", torch.float32)
    return Runtime(resolved, resolved.config, target.eval(), mtp.eval(), None, torch.device("cpu"), torch.float32)
