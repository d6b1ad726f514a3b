"""``dp_shard_size: auto`` through the trainer's resolve_layout: the planner picks a layout. No processes."""

import pytest
from transformers import LlamaConfig

from ndparallel.config.reading import parse_config
from ndparallel.mesh.layout import Layout
from ndparallel.parallel.rules import check_model
from ndparallel.planner.plan import best_layout
from ndparallel.train.setup import resolve_layout

BASE = {"model_shape": "tiny", "datasets": [{"path": "data.jsonl", "type": "completion"}], "sequence_len": 64}
TINY = LlamaConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=8,
    max_position_embeddings=64,
)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("method", ["allgather", "ring"])
def test_auto_gives_a_valid_layout_of_the_world_size_and_a_reason(world, method):
    cfg = parse_config({**BASE, "dp_shard_size": "auto", "micro_batch_size": 2, "cp_comm_strategy": method})
    layout, reason = resolve_layout(cfg, world, TINY)
    assert isinstance(layout, Layout)
    assert layout.world_size == world
    check_model(layout, TINY, seq_len=cfg.sequence_len)
    assert isinstance(reason, str) and reason.strip()
    assert layout.cp == 1 or layout.cp_comm_strategy == method


def test_without_auto_the_configured_sizes_and_no_reason():
    cfg = parse_config({**BASE, "tp_size": 2})
    layout, reason = resolve_layout(cfg, 8, TINY)
    assert layout.shape == (1, 4, 1, 2) and reason is None


def test_best_layout_takes_a_transformers_config_and_the_one_configured_cp_method():
    for method in ("allgather", "ring", "alltoall"):
        layout, reason = best_layout(TINY, 4, 64, cp_comm_strategy=method, constraints={"cp": 2})
        assert layout.cp == 2 and layout.cp_comm_strategy == method
        assert f"({method})" in reason
    with pytest.raises(Exception, match="cp_comm_strategy"):
        best_layout(TINY, 4, 64, cp_comm_strategy="ulysses")


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_auto_plans_for_the_checkpointing_the_run_will_use(mode):
    cfg = parse_config({**BASE, "dp_shard_size": "auto", "activation_checkpointing": mode})
    _, reason = resolve_layout(cfg, 2, TINY)
    assert f"activation_checkpointing={mode}" in reason


def test_auto_with_load_in_4bit_keeps_tensor_parallelism_off():
    """The trainer passes the quantized base to the planner: with load_in_4bit it never plans tp (which NF4
    refuses at build time) on a model whose bf16-base plan uses it."""
    big = LlamaConfig(
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        max_position_embeddings=8192,
    )
    lora = {**BASE, "dp_shard_size": "auto", "sequence_len": 8192, "adapter": "lora", "lora_r": 16}
    lora["lora_target_linear"] = True
    bf16, _ = resolve_layout(parse_config(lora), 8, big)
    nf4, _ = resolve_layout(parse_config({**lora, "adapter": "qlora", "load_in_4bit": True}), 8, big)
    assert nf4.tp == 1, nf4
    assert bf16.tp > 1, bf16
