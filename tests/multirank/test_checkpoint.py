"""Checkpoints of the trainer: exact resume (the fixture saves asynchronously), resume under another layout
and world size, HF export, and checkpoints that are damaged or malicious, refused on every rank."""

from __future__ import annotations

import shutil

import pytest
import torch
from support import malicious
from support.scenarios import max_rel_diff
from support.trainer_helpers import full_state, layout_config, losses, run_train, tiny_config
from transformers import AutoModelForCausalLM

import ndparallel as ndp
from ndparallel.errors import CheckpointError
from ndparallel.testing.ranks import run_ranks

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
    for name in (
        "COMPLETE",
        "index.json",
        "config.yaml",
        "hf_config.json",
        "tokenizer",
        "tensors/.metadata",
        "ranks/rank-7.json",
    ):
        assert (_step3(tmp) / name).exists(), name
    assert not list(root.glob(".partial-*"))


def test_resume_is_bitwise_exact(saved):
    tmp, config, uninterrupted = saved
    resumed = run_train(8, {**config, "output_dir": str(tmp / "resumed"), "resume_from_checkpoint": str(_step3(tmp))})
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert losses(resumed) == losses(uninterrupted)[3:]  # bitwise: same layout, fp32 on CPU
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in uninterrupted[3:]]


def _loaded_state(config: dict, checkpoint: str):
    from ndparallel.config.reading import parse_config
    from ndparallel.train.setup import setup

    run = setup(parse_config({**config, "resume_from_checkpoint": checkpoint}))
    return {"state": full_state(run.model, run.optimizer), "data": run.order.state_dict(), "step": run.state.step}


@pytest.fixture(scope="module")
def loaded_on_8(saved):
    """What the saving layout loads from step-3 (the reference for every other layout)."""
    tmp, config, _ = saved
    return run_ranks(8, _loaded_state, config, str(_step3(tmp)))[0]


@pytest.mark.parametrize(
    "layout, world",
    [
        (dict(s=4), 4),  # 2x2x2 on 8 ranks -> FSDP 4 on 4
        (dict(c=2, t=2, method="alltoall"), 4),  # -> TP 2 x CP 2 on 4
        (dict(r=2, t=1), 2),  # -> plain replicas on 2
        (dict(), 1),  # -> one process
    ],
    ids=["fsdp4", "cp2-tp2", "ddp2", "single"],
)
def test_resume_on_another_layout(saved, loaded_on_8, layout, world, parity_record):
    tmp, config, uninterrupted = saved
    checkpoint = str(_step3(tmp))
    original = loaded_on_8
    new_config = {**layout_config(config, **layout), "output_dir": str(tmp / f"reshard-{world}-{len(layout)}")}
    moved = run_ranks(world, _loaded_state, new_config, checkpoint)[0]
    assert moved["step"] == 3
    assert (
        moved["data"]["batches_done_in_epoch"]
        * new_config["micro_batch_size"]
        * (world // max(1, layout.get("c", 1) * layout.get("t", 1)))
        == original["data"]["batches_done_in_epoch"] * config["micro_batch_size"] * 2
    )
    assert original["state"].keys() == moved["state"].keys()
    for name, value in original["state"].items():
        assert torch.equal(value, moved["state"][name]), f"{name} differs after resharding"
    resumed = run_train(world, {**new_config, "resume_from_checkpoint": checkpoint})
    diff = max_rel_diff(losses(resumed), losses(uninterrupted)[3:])
    parity_record({"loss": diff})
    assert diff < 1e-5


def _trained_logits(config: dict, checkpoint: str):
    from ndparallel.config.reading import parse_config
    from ndparallel.train.setup import setup

    run = setup(parse_config({**config, "resume_from_checkpoint": checkpoint}))
    batch = ndp.prepare_batch(PROBE, run.topo)
    with torch.no_grad():
        logits = ndp.gather_logits(run.model(**batch.model_inputs()).logits, run.topo)
    return logits, run.topo.batch_rank


def test_export_gives_the_parallel_models_logits(saved, tmp_path, capsys):
    tmp, config, _ = saved
    from ndparallel.cli import main

    out = tmp_path / "hf"
    assert main(["export", str(tmp / "out"), str(out), "--dtype", "float32"]) == 0
    assert f"exported step 6 ({tmp / 'out' / 'checkpoints' / 'step-6'}) to {out}" in capsys.readouterr().out
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert list(out.glob("*.safetensors"))
    assert len({p.stat().st_mode & 0o777 for p in out.iterdir()}) == 1  # model.safetensors was 0600 alone
    exported = AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa").eval()
    assert exported.config.use_cache and exported.generation_config.use_cache  # generate keeps a KV cache
    with torch.no_grad():
        want = exported(input_ids=PROBE).logits
    results = run_ranks(
        8, _trained_logits, {**config, "output_dir": str(tmp_path / "o")}, str(tmp / "out" / "checkpoints" / "step-6")
    )
    for logits, batch_rank in results:
        rows = slice(batch_rank * 4, batch_rank * 4 + 4)
        assert float((logits - want[rows]).abs().max() / want.abs().max()) < 1e-5
    # Nothing is overwritten: exporting into the same directory again is refused.
    with pytest.raises(CheckpointError, match="not empty"):
        from ndparallel.weights.export import export_checkpoint

        export_checkpoint(tmp / "out", out)


# --- damaged and malicious checkpoints ------------------------------------------------------------------


def _damage(tmp, kind: str) -> tuple[str, str, str]:
    """A copy of step-3 damaged in one way: (output_dir, resume value, text the refusal must contain)."""
    bad = tmp / "bad" / kind
    shutil.rmtree(bad, ignore_errors=True)
    shutil.copytree(_step3(tmp), bad / "checkpoints" / "step-3", symlinks=True)
    ckpt = bad / "checkpoints" / "step-3"
    (bad / "checkpoints" / "latest").write_text("step-3")
    if kind == "truncated-shard":
        shard = sorted((ckpt / "tensors").glob("*.distcp"))[0]
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
        return str(bad), str(ckpt), "is truncated: it has"
    if kind == "corrupted-index":
        (ckpt / "tensors" / ".metadata").write_bytes(b"\x80\x04garbage")
        return str(bad), str(ckpt), "is not a readable checkpoint index"
    if kind == "missing-complete":
        (ckpt / "COMPLETE").unlink()
        return str(bad), str(ckpt), "COMPLETE is missing"
    if kind == "format-1":
        (ckpt / "index.json").rename(ckpt / "trainer_state.json")
        return str(bad), str(ckpt), "written by an earlier ndparallel (format 1"
    if kind.startswith("latest-"):
        latest = bad / "checkpoints" / "latest"
        if kind == "latest-symlink":  # a link, even to a valid name: latest is a plain file ndparallel writes
            latest.unlink()
            (bad / "elsewhere").write_text("step-3")
            latest.symlink_to(bad / "elsewhere")
        else:
            latest.write_text("step-99" if kind == "latest-dangling" else "../../../etc")
        return (
            str(bad),
            "latest",
            {
                "latest-dangling": "points at 'step-99', which does not exist",
                "latest-escape": "which is not a checkpoint of this directory",
                "latest-symlink": "is not a plain file",
            }[kind],
        )
    if kind == "no-checkpoint":
        shutil.rmtree(bad / "checkpoints")
        return str(bad), "latest", "does not exist"
    if kind == "partial":
        ckpt.rename(bad / "checkpoints" / ".partial-step-4")
        return str(bad), str(bad / "checkpoints" / ".partial-step-4"), "interrupted save"
    marker, outside = tmp / "bad" / f"marker-{kind}", tmp / "bad" / f"outside-{kind}"
    outside.mkdir(exist_ok=True)
    return str(bad), str(ckpt), malicious.tamper(ckpt, kind, marker, outside)


DAMAGED = [
    "truncated-shard",
    "corrupted-index",
    "missing-complete",
    "format-1",
    "latest-dangling",
    "latest-escape",
    "latest-symlink",
    "no-checkpoint",
    "partial",
]


@pytest.fixture(scope="module")
def bad_checkpoints(saved):
    tmp, _, _ = saved
    return {kind: _damage(tmp, kind) for kind in DAMAGED + malicious.KINDS}


def _resume_errors(config: dict, cases: dict) -> dict:
    """On this rank, resume from each case; the error (None: it resumed)."""
    from ndparallel.config.reading import parse_config
    from ndparallel.train.setup import setup

    errors = {}
    for kind, (output_dir, resume, _) in cases.items():
        try:
            setup(
                parse_config({**config, "output_dir": output_dir, "resume_from_checkpoint": resume})
            ).checkpointer.close()
            errors[kind] = None
        except CheckpointError as exc:
            errors[kind] = str(exc)
    return errors


def _check_refusals(errors: dict, cases: dict) -> list[str]:
    problems = []
    for kind, (_, _, expected) in cases.items():
        message = errors[kind]
        if not expected:
            if message is not None:
                problems.append(f"{kind}: refused ({message})")
        elif message is None or expected not in message or "\n" in message:
            problems.append(f"{kind}: {message!r} (wanted one line with {expected!r})")
    return problems


def test_damaged_and_malicious_checkpoints_are_refused_on_every_rank(saved, bad_checkpoints):
    tmp, config, _ = saved
    small = layout_config(config, s=2)
    per_rank = run_ranks(2, _resume_errors, small, bad_checkpoints, timeout_s=300)
    problems = [f"rank {r}: {p}" for r, errors in enumerate(per_rank) for p in _check_refusals(errors, bad_checkpoints)]
    assert not problems, "\n".join(problems)
    assert not list((tmp / "bad").glob("marker-*")), "a payload ran"


def test_export_goes_through_the_same_guard(saved, bad_checkpoints, tmp_path):
    """Export refuses what it would read; the per-rank state files it never opens (their payloads stay inert)."""
    from ndparallel.weights.export import export_checkpoint

    tmp, _, _ = saved
    unread = {"rank-file-reduce", "rank-file-build", "state-json-unknown-entry"}
    bad_checkpoints = {k: (*v[:2], "" if k in unread else v[2]) for k, v in bad_checkpoints.items()}
    errors = {}
    for kind, (output_dir, resume, _) in bad_checkpoints.items():
        try:
            export_checkpoint(output_dir if resume == "latest" else resume, tmp_path / kind, dtype="float32")
            errors[kind] = None
        except CheckpointError as exc:
            errors[kind] = str(exc)
    problems = _check_refusals(errors, bad_checkpoints)
    assert not problems, "\n".join(problems)
    assert not list((tmp / "bad").glob("marker-*")), "a payload ran"


def test_the_payloads_are_live(tmp_path):
    """Without the guard each payload runs: plain pickle for the index, torch.load for shard items."""
    marker = tmp_path / "marker"
    for name, data in malicious.payloads(marker).items():
        assert malicious.payload_is_live(data, marker), name
        if name in ("dotted-name", "reduce", "build", "newobj"):
            assert malicious.payload_is_live(malicious.torch_saved(data), marker, torch_load=True), name


def test_checkpoint_of_another_model_shape_is_refused(saved):
    tmp, config, _ = saved
    other = {
        **layout_config(config, s=2),
        "model_config_overrides": {"vocab_size": 320, "intermediate_size": 192},
        "output_dir": str(tmp / "other-shape"),
    }
    cases = {"shape": (str(tmp / "other-shape"), str(_step3(tmp)), "intermediate_size: checkpoint 128 vs model 192")}
    errors = run_ranks(2, _resume_errors, other, cases, timeout_s=120)
    assert all(not _check_refusals(e, cases) for e in errors), errors


def test_tokens_resume_from_a_save_between_logging_steps(tmp_path):
    """Saved at step 3 while logging every 2 steps: the resumed run's token count goes on from step 3's."""
    config = tiny_config(tmp_path, max_steps=4, save_steps=3, logging_steps=2, micro_batch_size=4)
    uninterrupted = run_train(1, config)
    resumed = run_train(
        1,
        {
            **config,
            "output_dir": str(tmp_path / "resumed"),
            "resume_from_checkpoint": str(tmp_path / "out" / "checkpoints" / "step-3"),
        },
    )
    assert [r["step"] for r in resumed] == [4]
    assert resumed[-1]["tokens"] == uninterrupted[-1]["tokens"]
