"""Layouts from sizes: the -1 fill, validation messages, groups and descriptions. No processes."""

import pytest
from transformers import LlamaConfig

from ndparallel import LayoutError, ParallelismConfig
from ndparallel.mesh.layout import Layout
from ndparallel.parallel.rules import model_problems

# (sizes, world, expected (dp_replicate, dp_shard, cp, tp)), one comment per row.
GOOD = [
    (dict(), 8, (8, 1, 1, 1)),  # no size at all: plain replicas over every rank (Accelerate's meaning)
    (dict(dp_shard_size=-1), 8, (1, 8, 1, 1)),  # FSDP over every rank
    (dict(dp_shard_size=-1, tp_size=2), 8, (1, 4, 1, 2)),  # -1 fills what tp leaves
    (dict(dp_replicate_size=2, dp_shard_size=-1, cp_size=2), 8, (2, 2, 2, 1)),
    (dict(dp_replicate_size=2, dp_shard_size=1, tp_size=4), 8, (2, 1, 1, 4)),  # TP with plain replicas
    (dict(dp_shard_size=1, cp_size=8), 8, (1, 1, 8, 1)),  # CP alone, no FSDP
    (dict(dp_shard_size=1), 1, (1, 1, 1, 1)),  # one process
    (dict(dp_replicate_size=2, dp_shard_size=2, cp_size=2, tp_size=2), 16, (2, 2, 2, 2)),
]


@pytest.mark.parametrize("sizes, world, shape", GOOD)
def test_resolve(sizes, world, shape):
    assert ParallelismConfig(**sizes).resolve(world).shape == shape


BAD = [
    (dict(tp_size=0), 8, "tp_size=0 must be a whole number >= 1"),
    (dict(cp_size=-2), 8, "cp_size=-2"),
    (dict(dp_replicate_size=2.5), 8, "dp_replicate_size=2.5"),
    (dict(dp_shard_size=-3), 8, "dp_shard_size=-3 must be >= 1, or -1"),
    (dict(dp_shard_size=0), 8, "dp_shard_size=0"),
    (dict(dp_shard_size=2, tp_size=2), 8, "= 4, but 8 processes were started"),
    (dict(tp_size=3), 8, "does not divide the world size 8"),
    (dict(cp_comm_strategy="ring_attn"), 8, "cp_comm_strategy='ring_attn' is not a method"),
]


@pytest.mark.parametrize("sizes, world, message", BAD)
def test_bad_sizes_name_the_setting(sizes, world, message):
    with pytest.raises(
        LayoutError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.").replace("+", r"\+")
    ):
        ParallelismConfig(**sizes).resolve(world)


def test_env_variables_fill_unset_fields(monkeypatch):
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_COMM_STRATEGY", "ring")
    cfg = ParallelismConfig(dp_replicate_size=1)
    assert (cfg.tp_size, cfg.cp_size, cfg.cp_comm_strategy) == (2, 2, "ring")
    assert cfg.resolve(8).shape == (1, 2, 2, 2)
    # An explicit value wins over the environment.
    assert ParallelismConfig(tp_size=1).tp_size == 1


def test_env_variable_must_be_an_integer(monkeypatch):
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "four")
    with pytest.raises(LayoutError, match="PARALLELISM_CONFIG_DP_SHARD_SIZE='four' is not an integer"):
        ParallelismConfig()


MODEL = LlamaConfig(
    num_attention_heads=12, num_key_value_heads=4, hidden_size=768, intermediate_size=2000, vocab_size=32002
)


@pytest.mark.parametrize(
    "layout, problems",
    [
        (Layout(tp=4), []),  # the vocabulary need not divide: 32,002 rows split 8,001 x 3 + 7,999
        (Layout(tp=8), ["attention heads (num_attention_heads=12)", "key/value heads (num_key_value_heads=4)"]),
        (Layout(tp=3), ["key/value heads (num_key_value_heads=4)", "intermediate size (intermediate_size=2000)"]),
        (Layout(cp=8, cp_comm_strategy="alltoall"), ["cp_comm_strategy='alltoall' splits attention heads"]),
        (Layout(cp=2, tp=2, cp_comm_strategy="alltoall"), []),  # 12 heads split 4 ways: fine
        (Layout(dp_shard=8, cp=2), []),
    ],
)
def test_model_problems_are_all_reported(layout, problems):
    found = list(model_problems(layout, MODEL))
    assert len(found) == len(problems), found
    for text, expected in zip(found, problems):
        assert expected in text


def test_more_key_value_heads_than_query_heads_is_one_line_not_a_crash():
    # transformers builds it; its attention would then divide by zero (SIGFPE on CPU) at the first step
    config = LlamaConfig(num_attention_heads=4, num_key_value_heads=8, hidden_size=256, intermediate_size=64)
    (problem,) = model_problems(Layout(), config)
    assert "num_attention_heads=4 is not a multiple of num_key_value_heads=8" in problem


def test_sequence_too_short_for_cp_and_tp():
    (problem,) = model_problems(
        Layout(cp=4, tp=2),
        LlamaConfig(num_attention_heads=8, num_key_value_heads=8, intermediate_size=64, vocab_size=64),
        seq_len=8,
    )
    assert "sequence_len=8 is shorter than 2 x cp_size x tp_size = 16" in problem


def test_rank_coordinates_and_groups_follow_mesh_order():
    layout = Layout(dp_replicate=2, dp_shard=2, cp=1, tp=2)
    assert layout.coordinates(5) == {"dp_replicate": 1, "dp_shard": 0, "cp": 0, "tp": 1}
    assert layout.rank_of(dp_replicate=1, dp_shard=0, cp=0, tp=1) == 5
    assert layout.groups(("tp",)) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups(("dp_replicate", "dp_shard")) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.batch_index(5) == 2 and layout.batch_index(4) == 2
    assert layout.fsdp_size == 2 and layout.loss_size == 4 and layout.batch_size == 4


def test_describe_names_groups_and_what_each_rank_holds():
    text = Layout(dp_shard=2, cp=2, tp=2, cp_comm_strategy="ring").describe()
    assert text.splitlines()[0] == "world 8 = dp_replicate 1 x dp_shard 2 x cp 2 x tp 2 (cp method: ring)"
    assert "dp_shard_cp (dp_shard x cp): [0,2,4,6] [1,3,5,7]" in text
    assert "tp: [0,1] [2,3] [4,5] [6,7]" in text
    assert "rank 3: (r0, s0, c1, t1) data rows 0/2, seq chunks 1,2, tp slice 1/2" in text
