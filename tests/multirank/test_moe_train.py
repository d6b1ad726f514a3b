"""``ndparallel train`` on a mixture-of-experts model: expert parallelism, LoRA on attention and experts,
checkpoints that resume on a layout without expert parallelism, and a merged Hugging Face export that gives
the trained model's logits."""

from __future__ import annotations

import pytest
import torch
from support.scenarios import max_rel_diff
from support.trainer_helpers import losses, run_train, tiny_config
from transformers import AutoModelForCausalLM

import ndparallel as ndp
from ndparallel.testing.ranks import run_ranks

MOE = {
    "model_type": "qwen3_moe",
    "vocab_size": 320,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 8,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "output_router_logits": True,
    "router_aux_loss_coef": 0.1,
}
LORA = {
    "adapter": "lora",
    "lora_r": 4,
    "lora_alpha": 8,
    "lora_target_modules": ["q_proj", "o_proj"],
    "lora_target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    "learning_rate": 1e-2,
}
PROBE = torch.randint(0, 320, (4, 32), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """6 steps on dp_shard 2 x ep 2 (the experts split over both ranks), saving at steps 3 and 6."""
    tmp = tmp_path_factory.mktemp("moe")
    config = tiny_config(
        tmp,
        model_shape=None,
        model_config_overrides=MOE,
        save_steps=3,
        dp_shard_size=2,
        expert_parallel_size=2,
        micro_batch_size=4,
        **LORA,
    )
    return tmp, config, run_train(2, config)


def test_lora_run_learns(saved):
    _, _, records = saved
    assert losses(records)[-1] < losses(records)[0] - 0.2


def test_resume_without_expert_parallelism(saved, parity_record):
    tmp, config, uninterrupted = saved
    moved = {
        **config,
        "dp_shard_size": 1,
        "tensor_parallel_size": 2,
        "expert_parallel_size": 1,
        "micro_batch_size": 8,
        "output_dir": str(tmp / "moved"),
        "resume_from_checkpoint": str(tmp / "out" / "checkpoints" / "step-3"),
    }
    resumed = run_train(2, moved)
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


def test_merged_export_gives_the_trained_logits(saved, tmp_path):
    tmp, config, _ = saved
    from ndparallel.cli import main

    out = tmp_path / "hf"
    assert main(["export", str(tmp / "out"), str(out), "--merge-lora", "--dtype", "float32"]) == 0
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not any("lora" in name for name, _ in exported.named_parameters())
    with torch.no_grad():
        want = exported(input_ids=PROBE).logits
    results = run_ranks(
        2, _trained_logits, {**config, "output_dir": str(tmp_path / "o")}, str(tmp / "out" / "checkpoints" / "step-6")
    )
    for logits, batch_rank in results:
        rows = slice(batch_rank * 2, batch_rank * 2 + 2)
        assert float((logits - want[rows]).abs().max() / want.abs().max()) < 1e-5
    assert (tmp / "out" / "adapter" / "adapter_config.json").is_file()  # the PEFT adapter, written at the end


def _loaded_weights(config: dict):
    from support.trainer_helpers import full_state

    from ndparallel.config.reading import parse_config
    from ndparallel.train.setup import setup

    run = setup(parse_config(config))
    return full_state(run.model)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_hub_checkpoint_loads_into_expert_parallel_layout(tmp_path, family):
    """A Hub-layout directory (one tensor per expert, Mixtral's block_sparse_moe names, DeepSeek's routing bias)
    loads into a dp_shard 2 x ep 2 run with every weight as transformers loads it."""
    from support.moe_scenarios import make_moe_model

    model = make_moe_model(family, vocab_size=320)  # the byte tokenizer's 262 tokens fit
    for module in model.modules():  # a routing bias that is not its initial zeros
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias.copy_(torch.randn(module.e_score_correction_bias.shape))
    model.save_pretrained(tmp_path / "model")
    want = AutoModelForCausalLM.from_pretrained(tmp_path / "model").state_dict()
    config = tiny_config(
        tmp_path,
        model_shape=None,
        base_model=str(tmp_path / "model"),
        model_config_overrides={},
        dp_shard_size=2,
        expert_parallel_size=2,
        micro_batch_size=4,
    )
    got = run_ranks(2, _loaded_weights, config)[0]
    assert {f"model.{k}" for k in want} == set(got)
    for name, value in want.items():
        assert torch.equal(got[f"model.{name}"], value), name
