"""The training config: Axolotl names accepted, every mistake reported as one line that names the field."""

import pytest

from ndparallel.config.reading import apply_overrides, config_errors, field_docs, parse_config

BASE = {"model_shape": "tiny", "datasets": [{"path": "data.jsonl", "type": "completion"}]}


def test_axolotl_and_accelerate_names():
    cfg = parse_config(
        {
            **BASE,
            "tensor_parallel_size": 2,
            "context_parallel_size": 4,
            "dp_shard_size": 2,
            "gradient_checkpointing": True,
            "sample_packing": True,
            "micro_batch_size": 2,
            "lora_r": 8,
        }
    )
    assert (cfg.tensor_parallel_size, cfg.context_parallel_size, cfg.dp_shard_size) == (2, 4, 2)
    assert cfg.ac_mode == "full"
    alias = parse_config({**BASE, "tp_size": 2, "cp_size": 2})
    assert (alias.tensor_parallel_size, alias.context_parallel_size) == (2, 2)
    assert parse_config({**BASE, "dp_shard_size": 2, "tp_size": 2}).fixed_world_size() == 4
    assert parse_config(BASE).fixed_world_size() is None


# (settings added to BASE, the text one reported line must contain), one comment per row.
BAD = [
    ({"learnig_rate": 1e-4}, "unknown setting 'learnig_rate'; did you mean 'learning_rate'?"),
    ({"tensor_paralel_size": 2}, "did you mean 'tensor_parallel_size'?"),
    ({"datasets": [{"path": "x", "typ": "alpaca"}]}, "unknown setting datasets[0].typ; did you mean 'type'?"),
    ({"learning_rate": "fast"}, "learning_rate: Input should be a valid number"),
    ({"learning_rate": -1}, "learning_rate: Input should be greater than 0"),
    ({"micro_batch_size": 0}, "micro_batch_size: Input should be greater than or equal to 1"),
    ({"tp_size": 0}, "tp_size: Input should be greater than or equal to 1"),
    ({"context_parallel_size": -2}, "context_parallel_size: Input should be greater than or equal to 1"),
    ({"dp_shard_size": -3}, "dp_shard_size"),
    ({"dp_shard_size": 0}, "must be >= 1, -1 (fill the remaining ranks) or auto"),
    ({"cp_comm_strategy": "ulysses"}, "cp_comm_strategy: Input should be 'allgather', 'ring' or 'alltoall'"),
    (
        {"lr_scheduler": "cosine_with_restarts"},
        "lr_scheduler: Input should be 'cosine', 'linear', 'constant' or 'constant_with_warmup'",
    ),
    ({"sequence_len": 4}, "sequence_len: Input should be greater than or equal to 8"),
    ({"fp16": True}, "fp16 is not supported: set bf16: true"),
    ({"adapter": "lora"}, "adapter: lora needs lora_target_modules"),
    ({"lora_target_linear": True}, "but adapter is not: add adapter: lora"),
    ({"adapter": "qlora"}, "adapter: qlora needs load_in_4bit: true"),
    ({"base_model": "/models/x"}, "base_model and model_shape are both set"),
    ({"datasets": []}, "datasets is empty"),
    ({"fsdp_wrap": 0}, "fsdp_wrap"),
    ({"nan_policy": "ignore"}, "nan_policy: Input should be 'stop' or 'skip'"),
    ({"val_set_size": "ten"}, "val_set_size: Input should be a valid number"),
    ({"max_steps": 0}, "max_steps: Input should be greater than or equal to 1"),
    ({"gradient_accumulation_steps": 1.5}, "gradient_accumulation_steps: Input should be a valid integer"),
    ({"long_rows": "cut"}, "long_rows: Input should be 'drop', 'truncate', 'error' or 'split'"),
    ({"fused_lora_mlp": True}, "fused_lora_mlp runs LoRA-adapted MLPs as one operator: add adapter: lora"),
    (
        {"fused_lora_mlp": True, "adapter": "lora", "lora_target_linear": True, "lora_dropout": 0.1},
        "fused_lora_mlp has no LoRA dropout (lora_dropout: 0.1): set lora_dropout: 0",
    ),
    (
        {"fused_lora_mlp": True, "adapter": "lora", "lora_target_linear": True, "tensor_parallel_size": 2},
        "fused_lora_mlp computes each MLP from whole weights: not with tensor_parallel_size > 1",
    ),
]


@pytest.mark.parametrize("extra, message", BAD)
def test_each_mistake_is_one_clear_line(extra, message):
    errors = config_errors({**BASE, **extra})
    assert errors, f"{extra} was accepted"
    assert any(message in line for line in errors), errors
    assert all("\n" not in line for line in errors)


def test_all_mistakes_are_reported_at_once():
    errors = config_errors({**BASE, "learnig_rate": 1, "micro_batch_size": 0, "tp_size": "two"})
    assert len(errors) == 3


def test_no_model_is_an_error():
    assert config_errors({"datasets": BASE["datasets"]}) == [
        "no model: set base_model (a HF directory or hub id) or model_shape (tiny, 1b, 3b, 8b)"
    ]


def test_overrides_parse_values_as_yaml_and_nest():
    raw = apply_overrides(
        BASE,
        [
            "learning_rate=3e-4",
            "sample_packing=true",
            "datasets.0.path=other.jsonl",
            "model_config_overrides.vocab_size=320",
            "lora_target_modules=[q_proj, v_proj]",
        ],
    )
    assert raw["learning_rate"] == 3e-4 and raw["sample_packing"] is True
    assert raw["datasets"][0]["path"] == "other.jsonl" and BASE["datasets"][0]["path"] == "data.jsonl"
    assert raw["model_config_overrides"] == {"vocab_size": 320}
    assert raw["lora_target_modules"] == ["q_proj", "v_proj"]


def test_every_field_is_documented():
    lines = field_docs().splitlines()
    undocumented = [
        line
        for line in lines
        if "): " not in line
        and line.split(" (")[0]
        not in {
            "learning_rate",
            "adam_beta1",
            "adam_beta2",
            "adam_epsilon",
            "seed",
            "warmup_steps",
            "output_dir",
            "logging_steps",
            "lora_r",
            "lora_alpha",
            "lora_dropout",
            "dp_replicate_size",
            "tensor_parallel_size",
            "context_parallel_size",
        }
    ]
    assert not undocumented, undocumented
