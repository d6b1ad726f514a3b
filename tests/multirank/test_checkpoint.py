"""Checkpoints: exact resume, resume under another layout and world size, HF export, bad checkpoints."""

from __future__ import annotations

import os
import pickle
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

import ndparallel as ndp
from harness import run_ranks
from ndparallel.errors import CheckpointError
from scenarios import max_rel_diff
from trainer_helpers import full_state, layout_config, losses, run_train, tiny_config

PROBE = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """An uninterrupted 6-step run on (dp_shard 2, cp 2, tp 2) that saves at steps 3 and 6."""
    tmp = tmp_path_factory.mktemp("ckpt")
    config = layout_config(tiny_config(tmp, save_steps=3), s=2, c=2, t=2, method="ring")
    records = run_train(8, config)
    return tmp, config, records


def _step3(tmp):
    return tmp / "out" / "checkpoints" / "step-3"


def test_layout_of_a_checkpoint(saved):
    tmp, _, _ = saved
    root = tmp / "out" / "checkpoints"
    assert (root / "latest").read_text() == "step-6"
    for name in ("COMPLETE", "trainer_state.json", "config.yaml", "hf_config.json", "tokenizer", "model_optim/.metadata",
                 "rng/rank-7.pt"):
        assert (_step3(tmp) / name).exists(), name
    assert not list(root.glob(".partial-*"))


def test_resume_is_bitwise_exact(saved):
    tmp, config, uninterrupted = saved
    resumed = run_train(8, {**config, "output_dir": str(tmp / "resumed"), "resume_from_checkpoint": str(_step3(tmp))})
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert losses(resumed) == losses(uninterrupted)[3:]  # bitwise: same layout, fp32 on CPU
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in uninterrupted[3:]]


def _loaded_state(config: dict, checkpoint: str):
    from ndparallel.config import parse_config
    from ndparallel.train import setup

    run = setup(parse_config({**config, "resume_from_checkpoint": checkpoint}))
    return {"state": full_state(run.model, run.optimizer), "data": run.order.state_dict(), "step": run.state.step}


@pytest.mark.parametrize("layout, world", [
    (dict(s=4), 4),                        # 2x2x2 on 8 ranks -> FSDP 4 on 4
    (dict(c=2, t=2, method="alltoall"), 4),  # -> TP 2 x CP 2 on 4
    (dict(r=2, t=1), 2),                    # -> plain replicas on 2
    (dict(), 1),                            # -> one process
], ids=["fsdp4", "cp2-tp2", "ddp2", "single"])
def test_resume_on_another_layout(saved, layout, world, parity_record):
    tmp, config, uninterrupted = saved
    checkpoint = str(_step3(tmp))
    original = run_ranks(8, _loaded_state, config, checkpoint)[0]
    new_config = {**layout_config(config, **layout), "output_dir": str(tmp / f"reshard-{world}-{len(layout)}")}
    moved = run_ranks(world, _loaded_state, new_config, checkpoint)[0]
    assert moved["step"] == 3
    assert moved["data"]["batches_done_in_epoch"] * new_config["micro_batch_size"] * (world // max(
        1, layout.get("c", 1) * layout.get("t", 1))) == original["data"]["batches_done_in_epoch"] * config[
        "micro_batch_size"] * 2
    assert original["state"].keys() == moved["state"].keys()
    for name, value in original["state"].items():
        assert torch.equal(value, moved["state"][name]), f"{name} differs after resharding"
    resumed = run_train(world, {**new_config, "resume_from_checkpoint": checkpoint})
    diff = max_rel_diff(losses(resumed), losses(uninterrupted)[3:])
    parity_record({"loss": diff})
    assert diff < 1e-5


def _trained_logits(config: dict, checkpoint: str):
    from ndparallel.config import parse_config
    from ndparallel.train import setup

    run = setup(parse_config({**config, "resume_from_checkpoint": checkpoint}))
    batch = ndp.prepare_batch(PROBE, run.topo)
    with torch.no_grad():
        logits = ndp.gather_logits(run.model(**batch.model_inputs()).logits, run.topo)
    return logits, run.topo.batch_rank


def test_export_gives_the_parallel_models_logits(saved, tmp_path):
    tmp, config, _ = saved
    from ndparallel.cli import main

    out = tmp_path / "hf"
    assert main(["export", str(tmp / "out"), str(out), "--dtype", "float32"]) == 0
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert list(out.glob("*.safetensors"))
    exported = AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa").eval()
    with torch.no_grad():
        want = exported(input_ids=PROBE).logits
    results = run_ranks(8, _trained_logits, {**config, "output_dir": str(tmp_path / "o")},
                        str(tmp / "out" / "checkpoints" / "step-6"))
    for logits, batch_rank in results:
        rows = slice(batch_rank * 4, batch_rank * 4 + 4)
        assert float((logits - want[rows]).abs().max() / want.abs().max()) < 1e-5
    # Nothing is overwritten: exporting into the same directory again is refused.
    with pytest.raises(CheckpointError, match="not empty"):
        from ndparallel.export import export_checkpoint

        export_checkpoint(tmp / "out", out)


def _resume_error(config: dict, checkpoint: str):
    from ndparallel.config import parse_config
    from ndparallel.train import setup

    try:
        setup(parse_config({**config, "resume_from_checkpoint": checkpoint}))
    except CheckpointError as exc:
        return str(exc)
    return None


def _damage(tmp, kind: str):
    """A copy of step-3 damaged in one way; returns (resume value, expected message)."""
    bad = tmp / f"bad-{kind}"
    shutil.rmtree(bad, ignore_errors=True)
    shutil.copytree(_step3(tmp), bad / "checkpoints" / "step-3")
    ckpt = bad / "checkpoints" / "step-3"
    if kind == "truncated-shard":
        shard = sorted((ckpt / "model_optim").glob("*.distcp"))[0]
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
        return str(ckpt), "cannot read the shards"
    if kind == "corrupted-metadata":
        (ckpt / "model_optim" / ".metadata").write_bytes(b"\x80\x04garbage")
        return str(ckpt), "is corrupted"
    if kind == "malicious-metadata":  # an index that would run code when unpickled
        (ckpt / "model_optim" / ".metadata").write_bytes(pickle.dumps(_Exploit()))
        return str(ckpt), "references code (refusing to load posix.system)"
    if kind == "missing-complete":
        (ckpt / "COMPLETE").unlink()
        return str(ckpt), "COMPLETE is missing"
    if kind == "latest-dangling":
        (bad / "checkpoints" / "latest").write_text("step-99")
        return "latest", "points at 'step-99', which does not exist"
    if kind == "no-checkpoint":
        shutil.rmtree(bad / "checkpoints")
        return "latest", "does not exist"
    if kind == "missing-dir":
        return str(bad / "nowhere"), "is not a directory"
    if kind == "partial":
        (bad / "checkpoints" / ".partial-step-4").mkdir()
        return str(bad / "checkpoints" / ".partial-step-4"), "interrupted save"
    raise AssertionError(kind)


class _Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


BAD = ["truncated-shard", "corrupted-metadata", "malicious-metadata", "missing-complete", "latest-dangling", "no-checkpoint", "missing-dir",
       "partial"]


@pytest.mark.parametrize("kind", BAD)
def test_bad_checkpoints_fail_clearly_on_every_rank(saved, kind):
    tmp, config, _ = saved
    resume, expected = _damage(tmp, kind)
    small = {**layout_config(config, s=2), "output_dir": str(tmp / f"bad-{kind}")}
    messages = run_ranks(2, _resume_error, small, resume, timeout_s=120)
    assert all(m is not None and expected in m for m in messages), messages


def test_checkpoint_of_another_model_shape_is_refused(saved):
    tmp, config, _ = saved
    other = {**layout_config(config, s=2), "model_config_overrides": {"vocab_size": 320, "intermediate_size": 192},
             "output_dir": str(tmp / "other-shape")}
    messages = run_ranks(2, _resume_error, other, str(_step3(tmp)), timeout_s=120)
    assert all("another model shape" in m and "intermediate_size: checkpoint 128 vs model 192" in m for m in messages)
