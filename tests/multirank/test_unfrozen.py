"""unfrozen_parameters (a full fine-tune of some weights) on 2x2x2 and on one rank, against plain PyTorch with the
same weights frozen by hand: losses, gradient norms, final weights; frozen weights stay bit-identical; a
checkpoint resumes on another layout."""

from __future__ import annotations

import pytest
import torch
from support.scenarios import make_model, max_rel_diff
from support.trainer_helpers import assert_runs_match, layout_config, losses, plain_reference, run_train, tiny_config
from transformers import AutoModelForCausalLM

from ndparallel.cli import main

# layer 0 and the embeddings stay frozen (so backward stops inside layer 1), layer 1's MLP, the final norm and
# the untied head train
PATTERNS = ["model.layers.1.mlp", "^model.norm", "^lm_head.weight$"]
TRAINED = {
    "model.layers.1.mlp.gate_proj.weight",
    "model.layers.1.mlp.up_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
    "model.norm.weight",
    "lm_head.weight",
}


@pytest.mark.slow
def test_unfrozen_parameters_train_like_plain_pytorch(tmp_path, parity_record):
    base_dir = tmp_path / "base"
    make_model("llama", vocab_size=320, seed=5).save_pretrained(base_dir)
    config = tiny_config(
        tmp_path,
        base_model=str(base_dir),
        model_shape=None,
        model_config_overrides={},
        learning_rate=1e-2,
        save_steps=3,
        unfrozen_parameters=PATTERNS,
    )
    parallel_config = {**layout_config(config, s=2, c=2, t=2, method="ring"), "output_dir": str(tmp_path / "par")}
    parallel = run_train(8, parallel_config)
    single = run_train(1, {**config, "output_dir": str(tmp_path / "single")})
    ref = plain_reference(layout_config(parallel_config), trainable=TRAINED)
    assert_runs_match([single, parallel], ref, parity_record)
    assert parallel[-1]["loss"] < parallel[0]["loss"]
    # resumed on one rank from the 2x2x2 checkpoint (AdamW state for the trained weights only)
    step3 = tmp_path / "par" / "checkpoints" / "step-3"
    resumed = run_train(1, {**config, "output_dir": str(tmp_path / "resumed"), "resume_from_checkpoint": str(step3)})
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert max_rel_diff(losses(resumed), losses(parallel)[3:]) < 1e-5

    out = tmp_path / "exported"
    assert main(["export", str(tmp_path / "par"), str(out), "--dtype", "float32"]) == 0
    got = dict(AutoModelForCausalLM.from_pretrained(out).named_parameters())
    base = dict(AutoModelForCausalLM.from_pretrained(base_dir).named_parameters())
    for name, want in ref["state"].items():
        if name in TRAINED:
            assert not torch.equal(want, base[name]), name  # it trained
            scale = float(want.abs().max())
            assert float((got[name].detach() - want).abs().max()) / scale < 1e-5, name
        else:
            assert torch.equal(got[name], base[name]), name  # frozen: untouched, bit for bit


@pytest.mark.slow
def test_published_expert_names_train_the_stacked_experts_under_expert_parallelism(tmp_path, parity_record):
    """Mixtral named as its checkpoints name it (block_sparse_moe): layer 1's router and experts train, split
    over dp_shard 2 x ep 2, like one rank; everything else stays as loaded."""
    from support.moe_scenarios import make_moe_model

    make_moe_model("mixtral", vocab_size=320).save_pretrained(tmp_path / "model")
    config = tiny_config(
        tmp_path,
        model_shape=None,
        base_model=str(tmp_path / "model"),
        model_config_overrides={},
        micro_batch_size=4,
        learning_rate=1e-2,
        save_steps=6,
        unfrozen_parameters=["model.layers.1.block_sparse_moe"],
    )
    single = run_train(1, {**config, "output_dir": str(tmp_path / "single")})
    split = {**config, "dp_shard_size": 2, "expert_parallel_size": 2, "micro_batch_size": 2}
    parallel = run_train(2, {**split, "output_dir": str(tmp_path / "ep")})
    loss_diff = max_rel_diff(losses(parallel), losses(single))
    norm_diff = max_rel_diff([r["grad_norm"] for r in parallel], [r["grad_norm"] for r in single])
    parity_record({"loss": loss_diff, "grad_norm": norm_diff})
    assert loss_diff < 1e-5 and norm_diff < 1e-5

    out = tmp_path / "exported"
    assert main(["export", str(tmp_path / "ep"), str(out), "--dtype", "float32"]) == 0
    got = AutoModelForCausalLM.from_pretrained(out).state_dict()
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "model").state_dict()
    changed = {name for name in base if not torch.equal(got[name], base[name])}
    assert changed == {
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.experts.gate_up_proj",
        "model.layers.1.mlp.experts.down_proj",
    }
