"""Checkpoint directory rules in one process: keep-K, names never reused, what a state may hold."""

from __future__ import annotations

import math

import pytest
import torch

from ndparallel.checkpoint.checkpointer import Checkpointer
from ndparallel.checkpoint.codec import join_state, split_state
from ndparallel.errors import CheckpointError


def _states(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters()), "progress": {"seen": seed}}


def _names(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))


def test_keep_k_never_deletes_the_checkpoint_just_written_or_latest(tmp_path):
    """Resumed from step 3 while a step-6 of an abandoned run exists, save step 4 with keep 1."""
    root = tmp_path / "checkpoints"
    first = Checkpointer(root)
    for step in (3, 6):
        first.save(step, _states(step))
    resumed = Checkpointer(root, keep=1)
    states = _states()
    assert resumed.load(states, root / "step-3").step == 3 and states["progress"] == {"seen": 3}
    resumed.save(4, states)
    assert _names(root) == ["step-4"]  # the oldest saves go, by save time, not by step number
    assert (root / "latest").read_text() == "step-4"
    assert resumed.load(_states(), None).step == 4


def test_a_second_save_of_a_step_never_replaces_the_first(tmp_path):
    root = tmp_path / "checkpoints"
    ckpt = Checkpointer(root, keep=2)
    ckpt.save(6, _states(1))
    ckpt.save(6, _states(2))  # e.g. resumed from an earlier step and reached step 6 again
    assert _names(root) == ["step-6", "step-6-r1"] and (root / "latest").read_text() == "step-6-r1"
    states = _states()
    assert ckpt.load(states).step == 6 and states["progress"] == {"seen": 2}
    ckpt.save(7, _states(3))
    assert _names(root) == ["step-6-r1", "step-7"]


def test_a_failed_publication_keeps_latest_on_the_previous_checkpoint(tmp_path, monkeypatch):
    from ndparallel.checkpoint import store

    root = tmp_path / "checkpoints"
    ckpt = Checkpointer(root, keep=1)
    ckpt.save(1, _states(1))
    real = store.write_atomic

    def full_disk(path, text):
        if path.name == "latest":
            raise OSError(28, "No space left on device")
        return real(path, text)

    monkeypatch.setattr(store, "write_atomic", full_disk)
    with pytest.raises(CheckpointError, match="saving the checkpoint step-2 failed: OSError: .*No space left"):
        ckpt.save(2, _states(2))
    assert (root / "latest").read_text() == "step-1" and (root / "step-1" / "COMPLETE").is_file()
    assert Checkpointer(root).load(_states(), None).step == 1


def test_state_dicts_round_trip_through_json_and_tensors():
    state = {
        "lr": 0.1,
        "betas": (0.9, 0.95),
        "nan": math.nan,
        "ids": {3: "a", 7: [None, True]},
        "nested": [{"w": torch.ones(2)}],
        "__ndp__": "a user key that looks like ours",
    }
    skeleton, tensors = split_state("s", state)
    assert list(tensors) == ["s.nested.0.w"]
    back = join_state(skeleton, tensors, where="test")
    assert back["betas"] == (0.9, 0.95) and back["ids"] == {3: "a", 7: [None, True]} and math.isnan(back["nan"])
    assert back["nested"][0]["w"] is tensors["s.nested.0.w"] and back["__ndp__"] == state["__ndp__"]


def test_a_state_that_json_cannot_hold_is_refused_at_save_time(tmp_path):
    with pytest.raises(CheckpointError, match=r"s\.fn is a function, which a checkpoint does not store"):
        split_state("s", {"fn": lambda: 0})
    with pytest.raises(CheckpointError, match="'thing' is a object, which cannot be checkpointed"):
        Checkpointer(tmp_path).save(1, {"thing": object()})


def test_loading_into_another_shape_or_model_says_what_differs(tmp_path):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, {"model": torch.nn.Linear(3, 2)})
    with pytest.raises(CheckpointError, match=r"'model.weight' has shape \(2, 3\) there and \(4, 3\) here"):
        ckpt.load({"model": torch.nn.Linear(3, 4)})
    with pytest.raises(CheckpointError, match=r"has no tensor 'model.0.weight'"):
        ckpt.load({"model": torch.nn.Sequential(torch.nn.Linear(3, 2))})
    with pytest.raises(CheckpointError, match=r"holds \['model'\], not \['optimizer'\]"):
        ckpt.load({"optimizer": {}})
