"""`glm5mtp train` for GLM-5-Next at a toy size (CPU, seconds): the batched training forward equals
the inference path, gradients reach every tensor, and a few steps write a checkpoint the engine
loads and speculates with losslessly."""

import json
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from glm5mtp_cli.engine.config import ModelSpec
from glm5mtp_cli.checkpoint.random import fill_random
from glm5mtp_cli.cli import app
from glm5mtp_cli.checkpoint.resolve import profile_path
from glm5mtp_cli.core.families import family_of, load_config, parse_config
from glm5mtp_cli.models.glm5_next import training as tr

sys.path.insert(0, str(Path(__file__).parent))
from glm5next_reference import Mtp, Target, boundary_ties  # noqa: E402

FILES = 12  # corpus slice (first N files of each split), as tests/test_train.py


def _models(seed: int = 0):
    cfg = load_config(profile_path("glm5next-tiny") / "config.json")  # index_topk 8: selection is active below
    fam = family_of(cfg)
    target, mtp = fam.build_target(cfg), fam.build_mtp(cfg)
    fill_random(target, "", seed)
    fill_random(mtp, fam.mtp_prefix(cfg), seed + 1)
    tr.training_init(target, seed)
    return cfg, target, mtp


def test_training_forward_equals_the_inference_path():
    cfg, target, mtp = _models()
    model, layer = target.model, mtp.layer
    x = torch.randint(2, cfg.vocab_size, (3, 37), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits, hidden, _ = tr.target_forward(model, x)
        draft, _, _, _ = tr.mtp_forward(layer, hidden[:, :-1], x[:, 1:], model.embed_tokens, model.lm_head)
    ref, ref_layer = Target(model), Mtp(layer)  # the one-sequence reference path
    for b in range(x.shape[0]):
        ref_logits, ref_hidden = ref.forward(x[b])  # prefill over a scratch state
        rows = ref.forward_rows(x[b], ref.new_state(x.shape[1]))[2]
        for i, p in rows.layers.items():  # no exact tie at a top-k boundary (where topk may differ by shape)
            if not model.layers[i].kda:
                visible = (torch.arange(x.shape[1]) + 1) // cfg.index_kpool
                assert not boundary_ties(p.scores, visible, cfg.index_topk // cfg.index_kpool).any()
        with torch.no_grad():
            ref_draft, _, _ = ref_layer.forward_rows(x[b, 1:], ref_hidden[:-1], ref_layer.new_state(x.shape[1]),
                                                 model.embed_tokens, model.lm_head)
        torch.testing.assert_close(logits[b], ref_logits, atol=1e-4, rtol=0)
        torch.testing.assert_close(hidden[b], ref_hidden, atol=1e-4, rtol=0)
        torch.testing.assert_close(draft[b], ref_draft, atol=1e-4, rtol=0)


def test_the_chained_draft_equals_the_engines_chain_step_with_the_shared_top_k():
    """Row i of the training chain is the reference drafter's second chain row after the real row
    (x[i+1], h[i]), its token forced to x[i+2]: same keys (the step-0 selection and tail), same logits."""
    cfg, target, mtp = _models(3)
    assert cfg.index_share_for_mtp_iteration and cfg.index_kpool_always_select_tail
    model, layer = target.model, mtp.layer
    T = 41  # past index_topk 8 = 2 pools of 4: the shared selection leaves pools out
    x = torch.randint(2, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        _, hidden, _ = tr.target_forward(model, x)
        _, _, _, chained = tr.mtp_forward(layer, hidden[:, :-1], x[:, 1:], model.embed_tokens, model.lm_head,
                                          chain=True)
    assert chained.shape[1] == T - 2
    ref = Mtp(layer)
    embed, head = model.embed_tokens, model.lm_head
    for b in range(x.shape[0]):
        for i in (0, 3, 7, 20, T - 3):
            slot = ref.new_state(T)
            with torch.no_grad():
                if i:
                    ref.catchup(x[b, 1:i + 1], hidden[b, :i], slot, embed, head)
                _, g, pending = ref.forward_rows(x[b, i + 1:i + 2], hidden[b, i:i + 1], slot, embed, head)
                slot.apply(pending.commit(1))
                want, _, _ = ref.forward_rows(x[b, i + 2:i + 3], g, slot, embed, head, pending.selected)
            torch.testing.assert_close(chained[b, i], want[0], atol=1e-4, rtol=0)


def test_router_balancing_counts_both_mtp_calls_of_a_chained_step():
    cfg, target, mtp = _models()
    model, layer = target.model, mtp.layer
    mtp.train()
    x = torch.randint(2, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, hidden, _ = tr.target_forward(model, x)
        tr.mtp_forward(layer, hidden[:, :-1], x[:, 1:], model.embed_tokens, model.lm_head, chain=True)
    ids = layer.mlp.last_expert_ids
    assert ids.shape[0] == 2 * 19 + 2 * 18  # the first draft's rows and the chained draft's


def test_gradients_reach_every_tensor_and_the_indexer_loss_only_the_indexers():
    cfg, target, mtp = _models()
    model, layer = target.model, mtp.layer
    x = torch.randint(2, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    logits, hidden, aux = tr.target_forward(model, x, want_indexer_loss=True)
    draft, _, maux, chained = tr.mtp_forward(layer, hidden[:, :-1], x[:, 1:], model.embed_tokens, model.lm_head,
                                             True, chain=True)
    assert torch.isfinite(aux) and aux > 0 and torch.isfinite(maux) and maux > 0
    (aux + maux).backward(retain_graph=True)
    params = list(target.named_parameters()) + list(mtp.named_parameters())
    got = {n for n, p in params if p.grad is not None and p.grad.abs().sum() > 0}
    assert got and all(".indexer." in n for n in got)  # the indexer reads detached inputs
    (logits.float().logsumexp(-1).mean() + draft.float().logsumexp(-1).mean()
     + chained.float().logsumexp(-1).mean()).backward()
    assert [n for n, p in params if p.grad is None] == []


def _toy_config(tmp_path):
    raw = json.loads((profile_path("glm5next-tiny") / "config.json").read_text())
    raw["text_config"].update(vocab_size=512, max_position_embeddings=512)
    path = tmp_path / "next_toy.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("next_train")
    out = tmp / "out"
    args = ["train", "--config", str(_toy_config(tmp)), "--out", str(out), "--steps", "20", "--batch-size", "4",
            "--seq-len", "48", "--lr", "3e-3", "--corpus-files", str(FILES), "--cache-dir", str(tmp / "cache"),
            "--eval-every", "5", "--eval-tokens", "1024", "--device", "cpu", "--seed", "1"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    return out


def test_a_few_steps_lower_both_losses(trained):
    report = json.loads((trained / "train_report.json").read_text())
    assert report["steps_done"] == 20 and report["tokens_seen"] == 20 * 4 * 48
    first, final = report["history"][0]["heldout"], report["heldout"]
    for k in ("target_ce", "mtp_ce"):
        assert torch.isfinite(torch.tensor(final[k]))
        assert final[k] < first[k] - 0.05 and final[k] < 5.9  # ln(512) = 6.24 is the uniform loss
    assert report["final_train"]["indexer"] >= 0
    p = report["parameters"]
    assert p["total"] == p["target"] + p["mtp"] and p["bytes_bf16"] > 2 * p["total"] - 1000  # fp32 extras only add
    cfg = parse_config(json.loads((trained / "config.json").read_text()))
    assert cfg.model_type == "glm5_next" and cfg.torch_dtype == "bfloat16" and cfg.vocab_size == 512


def test_the_checkpoint_loads_and_speculates_losslessly(trained):
    from glm5mtp_cli.engine.runtime import load_runtime

    rt = load_runtime(ModelSpec(str(trained), "cpu", "fp32"), progress=False)
    bias = rt.target.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32
    res = CliRunner().invoke(app, ["generate", "--model", str(trained), "--prompt-ids", "5,17,99,4,250,31,8,9,10",
                                   "--gamma", "2", "--max-new-tokens", "10", "--ignore-eos", "--compare", "--json",
                                   "--device", "cpu", "--dtype", "fp32"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["compare"]["same_tokens"] is True and len(d["requests"][0]["tokens"]) == 10


def test_the_nano_profile_fits_its_budget():
    from glm5mtp_cli.training.options import load_train_config
    from glm5mtp_cli.training.train import count_params

    cfg, section, _ = load_train_config("glm5next-nano")
    p = count_params(cfg)
    assert cfg.model_type == "glm5_next" and cfg.vocab_size == 4096 and cfg.index_kpool == 4
    assert cfg.index_n_heads >= 16 and cfg.hc_mult == 4 and cfg.kda_layers and cfg.indexed_layers
    assert p["bytes_bf16"] <= 20 * 2**20 and section["seq_len"] > cfg.index_topk  # pool selection is trained


def test_the_distillation_loss_is_the_drafts_kl_from_the_detached_target():
    from glm5mtp_cli.training.train import _kl_from

    torch.manual_seed(0)
    teacher = torch.randn(2, 5, 11, requires_grad=True)
    student = torch.randn(2, 5, 11, requires_grad=True)
    kl = _kl_from(teacher, student)
    p, logq = teacher.softmax(-1), student.log_softmax(-1)
    want = (p * (p.log() - logq)).sum(-1).mean()
    torch.testing.assert_close(kl, want)
    kl.backward()
    assert teacher.grad is None and student.grad.abs().sum() > 0  # the target is the teacher, not moved
    assert _kl_from(student, student.detach().clone()).abs() < 1e-6


def test_distill_weight_trains_and_reports_the_kl(tmp_path):
    out = tmp_path / "out"
    args = ["train", "--config", str(_toy_config(tmp_path)), "--out", str(out), "--steps", "3", "--batch-size", "2",
            "--seq-len", "24", "--corpus-files", str(FILES), "--cache-dir", str(tmp_path / "cache"),
            "--eval-tokens", "256", "--device", "cpu", "--chain-weight", "0.5", "--distill-weight", "1.0"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    report = json.loads((out / "train_report.json").read_text())
    assert report["hyperparameters"]["distill_weight"] == 1.0
    assert report["final_train"]["kl_draft"] > 0
    args[args.index(str(out))] = str(tmp_path / "out2")
    res = CliRunner().invoke(app, args[:-1] + ["-1"])
    assert res.exit_code != 0 and "--distill-weight must not be negative" in res.output
