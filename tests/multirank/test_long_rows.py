"""The long-row memory features leave the numbers where they were: the fused loss (parallelize's default),
the MLP over sequence tiles and layer inputs offloaded to host memory, alone and together, on one rank and
under FSDP x CP x TP, against one plain process (fp32, 1e-5 as every parity test); offload against no
offload bit for bit."""

from __future__ import annotations

import functools

import pytest
import torch
from support.scenarios import assert_parity, make_batches, make_model, train_parallel, train_reference, world_size
from support.trainer_helpers import assert_runs_match, layout_config, plain_reference, run_train, tiny_config

import ndparallel as ndp
from ndparallel.parallel.tiled_mlp import tile_count
from ndparallel.testing.ranks import run_ranks

FULL = {"activation_checkpointing": "full"}
TILED = {**FULL, "tiled_mlp": True, "tiled_mlp_num_shards": 3}
OFFLOAD = {**FULL, "activation_offload_layers": 1}
EVERYTHING = {**TILED, "activation_offload_layers": 2}


@functools.lru_cache(maxsize=None)
def _batches():
    return make_batches(steps=3, micro=1, rows=4, seq=64, packed=True, pad=True, seed=11)


@functools.lru_cache(maxsize=None)
def _reference(family: str):
    return train_reference(make_model(family, num_hidden_layers=3), _batches())


def _train(family, layout, options):
    return train_parallel(family, layout, _batches(), model_kwargs={"num_hidden_layers": 3}, options=options)


@pytest.mark.parametrize(
    "layout, family, options",
    [
        pytest.param(dict(dp_shard_size=1), "llama", TILED, id="one-rank-tiled"),
        pytest.param(dict(dp_shard_size=1), "qwen3", EVERYTHING, id="one-rank-tiled-offloaded"),
        pytest.param(
            dict(dp_shard_size=2, cp_size=2, tp_size=2, cp_comm_strategy="ring"),
            "llama",
            EVERYTHING,
            id="fsdp2-cp2-tp2-tiled-offloaded",
        ),
        pytest.param(dict(tp_size=2, dp_shard_size=1), "phi3", TILED, id="tp2-fused-gate-up-tiled"),
    ],
)
def test_memory_features_match_one_process(layout, family, options, parity_record):
    got = run_ranks(world_size(layout), _train, family, layout, options)[0]
    parity_record(assert_parity(_reference(family), got))


def test_offload_is_bit_identical_and_releases_the_inputs():
    """One rank, CPU: the offloaded run's losses, norms and weights equal the plain full-checkpointing run's
    exactly, and between forward and backward the offloaded inputs hold no storage."""
    run_ranks(1, _offload_checks)


def _offload_checks():
    batches = _batches()
    plain = train_parallel("llama", dict(dp_shard_size=1), batches, model_kwargs={"num_hidden_layers": 3}, options=FULL)
    got = train_parallel(
        "llama", dict(dp_shard_size=1), batches, model_kwargs={"num_hidden_layers": 3}, options=OFFLOAD
    )
    assert got["losses"] == plain["losses"] and got["grad_norms"] == plain["grad_norms"]
    for name, value in plain["weights"].items():
        assert torch.equal(got["weights"][name], value), name
    # the release itself, observed between a forward and its backward
    topo = ndp.Topology.build(ndp.ParallelismConfig(dp_shard_size=1))
    model = make_model("llama", num_hidden_layers=3)
    ndp.parallelize(model, topo, options=ndp.ParallelOptions(param_dtype=None, activation_offload_layers=2, **FULL))
    batch = ndp.prepare_batch(topology=topo, **batches[0][0])
    n = ndp.count_tokens(batch.num_tokens, topo)
    loss, _ = ndp.model_loss(model, batch.model_inputs(), batch.labels, num_tokens=n, topology=topo)
    offload = model.model.layers[0].activation_offload
    released = [local.untyped_storage().nbytes() for local, _ in offload._stashed.values()]
    assert len(released) == 2 and released == [0, 0]  # layers 0 and 1 wait on the host; layer 2 stays
    loss.backward()
    assert not offload._stashed


def test_tile_count_follows_the_row():
    # 1B shape: hidden 2048, MLP 8192: tiles of max(2048, L*H/(4*I)) tokens
    assert tile_count(4096, hidden=2048, intermediate=8192) == 2
    assert tile_count(2048, hidden=2048, intermediate=8192) == 1  # short rows are not tiled
    assert tile_count(131_072, hidden=2048, intermediate=8192) == 16
    assert tile_count(1_048_576, hidden=2048, intermediate=8192) == 16  # tiles of 64k: one (L, H) tensor's size
    assert tile_count(100, hidden=64, intermediate=128, num_tiles=4) == 4


@pytest.fixture(scope="module")
def trainer_base(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("long-rows-train")
    make_model("llama", vocab_size=320, seed=3).save_pretrained(tmp / "base")
    config = tiny_config(tmp, base_model=str(tmp / "base"), model_shape=None, model_config_overrides={}, max_steps=4)
    return tmp, config, plain_reference(config)


@pytest.mark.parametrize(
    "world, layout, settings",
    [
        pytest.param(1, {}, {"fused_cross_entropy": False}, id="one-rank-unfused"),
        pytest.param(1, {}, {"gradient_checkpointing": True, "activation_offloading": True}, id="one-rank-offload"),
        pytest.param(
            4,
            dict(c=2, t=2, method="alltoall"),
            {
                "gradient_checkpointing": True,
                "tiled_mlp": True,
                "tiled_mlp_num_shards": 2,
                "activation_offloading": True,
                "activation_offload_layers": 1,
            },
            id="cp2-tp2-tiled-offload",
        ),
    ],
)
def test_trainer_with_each_feature_matches_plain_transformers(trainer_base, world, layout, settings, parity_record):
    """``ndparallel train`` with the features on (and the fused loss off) against the run written with plain
    transformers + torch (the fused loss is the trainer's default, so every other trainer test covers it)."""
    tmp, config, ref = trainer_base
    name = "-".join(f"{k}{v}" for k, v in {**layout, **settings}.items())
    run = {**layout_config(config, **layout), **settings, "output_dir": str(tmp / name)}
    assert_runs_match([run_train(world, run)], ref, parity_record)
