"""``ndparallel train`` on several layouts gives the losses of one process on the same config."""

from __future__ import annotations

import pytest
from support.scenarios import make_model, max_rel_diff
from support.trainer_helpers import layout_config, losses, plain_reference, run_train, tiny_config


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    make_model("llama", vocab_size=320, seed=3).save_pretrained(tmp / "base")  # a tiny Llama on disk
    config = tiny_config(tmp, base_model=str(tmp / "base"), model_shape=None, model_config_overrides={})
    records = run_train(1, {**config, "output_dir": str(tmp / "single")})
    return tmp, config, records


def test_one_process_matches_plain_transformers_and_torch(base, parity_record):
    """The trainer at world 1 against the same run written with transformers + torch only."""
    _, config, single = base
    ref = plain_reference(config)
    diff = max_rel_diff(losses(single), ref["losses"])
    norm_diff = max_rel_diff([r["grad_norm"] for r in single], ref["grad_norms"])
    parity_record({"loss": diff, "grad_norm": norm_diff})
    assert diff < 1e-5 and norm_diff < 1e-5, (losses(single), ref["losses"])


@pytest.mark.parametrize("cpu_offload", [False, True], ids=["flat", "cpu-offload"])
def test_one_process_keeps_tied_embeddings_tied(tmp_path, parity_record, cpu_offload):
    """A tied model (Llama 3.2's head is its embedding matrix) from a directory, on one rank (the flat buffers,
    or FSDP with CPU offload, which fills the weights before parallelizing): the checkpoint has no
    lm_head.weight and the run trains one shared matrix, as transformers does."""
    make_model("llama", vocab_size=320, seed=4, tied=True).save_pretrained(tmp_path / "base")
    config = tiny_config(tmp_path, base_model=str(tmp_path / "base"), model_shape=None, model_config_overrides={})
    config.update(max_steps=3, cpu_offload=cpu_offload)
    records = run_train(1, config)
    ref = plain_reference(config)
    diff = max_rel_diff(losses(records), ref["losses"])
    parity_record({"loss": diff})
    assert diff < 1e-5, (losses(records), ref["losses"])


@pytest.mark.parametrize(
    "layout",
    [
        dict(s=2, t=2),  # FSDP x TP
        dict(s=2, c=2, t=2, method="ring"),  # the three axes
        dict(r=2, c=2, method="alltoall"),  # CP with plain replicas
        dict(r=2, s=2, t=2),  # HSDP x TP
    ],
    ids=["fsdp2-tp2", "fsdp2-cp2-tp2-ring", "ddp2-cp2-alltoall", "hsdp2x2-tp2"],
)
def test_train_layouts_match_one_process(base, layout, parity_record):
    tmp, config, single = base
    world = layout.get("r", 1) * layout.get("s", 1) * layout.get("c", 1) * layout.get("t", 1)
    name = "-".join(f"{k}{v}" for k, v in layout.items())
    records = run_train(world, {**layout_config(config, **layout), "output_dir": str(tmp / name)})
    assert [r["step"] for r in records] == [r["step"] for r in single]
    diff = max_rel_diff(losses(records), losses(single))
    norm_diff = max_rel_diff([r["grad_norm"] for r in records], [r["grad_norm"] for r in single])
    parity_record({"loss": diff, "grad_norm": norm_diff})
    assert diff < 1e-5 and norm_diff < 1e-5, (losses(records), losses(single))
    assert records[-1]["tokens"] == single[-1]["tokens"]


def test_loss_falls_and_metrics_are_complete(base):
    _, _, single = base
    assert single[-1]["loss"] < single[0]["loss"] - 0.3
    keys = {
        "step",
        "loss",
        "grad_norm",
        "lr",
        "tokens",
        "tokens_per_s",
        "tokens_per_s_per_device",
        "mfu",
        "peak_memory_gib",
    }
    assert keys <= set(single[0])
    assert [r["tokens"] for r in single] == sorted(r["tokens"] for r in single)


def test_exact_repeats_are_left_out_of_training(base, tmp_path):
    """dataset_exact_deduplication reaches the trainer's data: every document twice in the corpus, deduplicated,
    trains like the plain reference on the deduplicated rows (and not like one on the doubled corpus)."""
    _, config, _ = base
    doubled = tmp_path / "doubled.jsonl"
    lines = open(config["datasets"][0]["path"]).read().splitlines()
    doubled.write_text("\n".join(lines + lines) + "\n")
    deduplicated = {
        **config,
        "datasets": [{"path": str(doubled), "type": "completion"}],
        "dataset_prepared_path": str(tmp_path / "prepared"),
        "dataset_exact_deduplication": True,
        "max_steps": 3,
        "output_dir": str(tmp_path / "out"),
    }
    records = run_train(1, deduplicated)
    reference = plain_reference(deduplicated)
    assert max_rel_diff(losses(records), reference["losses"]) < 1e-5
    repeated = plain_reference({**deduplicated, "dataset_exact_deduplication": False})
    assert max_rel_diff(repeated["losses"], reference["losses"]) > 1e-3


def test_curriculum_sampling_trains_on_the_rows_in_order(base, tmp_path):
    """curriculum_sampling (Axolotl's sequential sampler) on 2 data ranks: the plain reference reading the
    rows in order, and not the shuffled one."""
    _, config, _ = base
    sequential = {
        **layout_config(config, s=2),
        "curriculum_sampling": True,
        "max_steps": 3,
        "output_dir": str(tmp_path / "out"),
    }
    records = run_train(2, sequential)
    reference = plain_reference({**sequential, "dp_shard_size": 1, "micro_batch_size": config["micro_batch_size"]})
    assert max_rel_diff(losses(records), reference["losses"]) < 1e-5
    shuffled = plain_reference({**sequential, "curriculum_sampling": False, "dp_shard_size": 1, "micro_batch_size": 8})
    assert max_rel_diff(shuffled["losses"], reference["losses"]) > 1e-3
