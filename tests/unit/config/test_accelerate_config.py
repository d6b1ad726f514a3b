"""Accelerate's launch settings in `ndparallel train`/`validate`: an `accelerate config` file, its blocks in our
YAML, and PARALLELISM_CONFIG_* for sizes nothing else sets. No processes: `validate` shows the layout."""

from __future__ import annotations

import pytest
import yaml

from ndparallel.cli import main
from ndparallel.config.accelerate import merge, translate
from ndparallel.config.reading import parse_config
from ndparallel.errors import ConfigError

# What `accelerate config` writes for FSDP2 with TP and HSDP on 8 GPUs (the keys of Accelerate 1.15).
HSDP_TP = {
    "compute_environment": "LOCAL_MACHINE",
    "debug": False,
    "distributed_type": "FSDP",
    "downcast_bf16": "no",
    "enable_cpu_affinity": False,
    "machine_rank": 0,
    "main_training_function": "main",
    "mixed_precision": "bf16",
    "num_machines": 1,
    "num_processes": 8,
    "rdzv_backend": "static",
    "same_network": True,
    "tpu_env": [],
    "tpu_use_cluster": False,
    "tpu_use_sudo": False,
    "use_cpu": False,
    "fsdp_config": {
        "fsdp_activation_checkpointing": True,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_offload_params": False,
        "fsdp_reshard_after_forward": False,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
        "fsdp_version": 2,
    },
    "parallelism_config": {
        "parallelism_config_dp_replicate_size": 2,
        "parallelism_config_dp_shard_size": 2,
        "parallelism_config_tp_size": 2,
        "parallelism_config_cp_size": 1,
    },
}
RUN = {
    "model_shape": "byte-tiny",
    "datasets": [{"path": "stdlib:os.py", "type": "pretrain_files"}],
    "sequence_len": 64,
    "long_rows": "split",  # one document of 40k tokens: cut into rows (dropped, no data would be left)
}
SIZE_VARIABLES = ("DP_REPLICATE_SIZE", "DP_SHARD_SIZE", "TP_SIZE", "CP_SIZE", "CP_COMM_STRATEGY")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in SIZE_VARIABLES:
        monkeypatch.delenv("PARALLELISM_CONFIG_" + name, raising=False)


def test_a_whole_accelerate_file_translates():
    settings = translate(HSDP_TP)
    assert settings.fields == {
        "bf16": True,
        "activation_checkpointing": "full",
        "fsdp_wrap": "block",
        "cpu_offload": False,
        "reshard_after_forward": False,
        "dp_replicate_size": 2,
        "dp_shard_size": 2,
        "tensor_parallel_size": 2,
        "context_parallel_size": 1,
    }
    assert settings.launch == {"world_size": 8, "nproc_per_node": 8}
    assert settings.not_used == [
        "fsdp_transformer_layer_cls_to_wrap (ndparallel wraps every decoder layer of the model)"
    ]


def test_cp_method_unprefixed_fsdp_keys_and_several_machines():
    settings = translate(
        {
            "distributed_type": "FSDP",
            "num_processes": 16,
            "num_machines": 2,
            "machine_rank": 1,
            "main_process_ip": "10.0.0.1",
            "main_process_port": 29400,
            "fsdp_config": {"offload_params": True, "version": 2},
            "parallelism_config": {"parallelism_config_cp_size": 4, "parallelism_config_cp_comm_strategy": "alltoall"},
        }
    )
    assert settings.fields == {"cpu_offload": True, "context_parallel_size": 4, "cp_comm_strategy": "alltoall"}
    assert settings.launch == {
        "world_size": 16,
        "nproc_per_node": 8,
        "nnodes": 2,
        "node_rank": 1,
        "rdzv_endpoint": "10.0.0.1:29400",
    }


def test_plain_data_parallel_means_no_sharding():
    assert translate({"distributed_type": "MULTI_GPU"}).fields == {"dp_shard_size": 1}


@pytest.mark.parametrize(
    "accelerate, message",
    [
        ({"distributed_type": "DEEPSPEED"}, "distributed_type: DEEPSPEED is not supported"),
        ({"distributed_type": "FSDP", "deepspeed_config": {"zero_stage": 3}}, "deepspeed_config: DeepSpeed is not"),
        ({"distributed_type": "FSDP", "mixed_precision": "fp16"}, "mixed_precision: fp16 is not supported; use bf16"),
        (
            {"distributed_type": "FSDP", "parallelism_config": {"parallelism_config_sp_size": 2}},
            "sp_size=2 asks for DeepSpeed's ALST/Ulysses sequence parallelism",
        ),
        (
            {
                "distributed_type": "FSDP",
                "parallelism_config": {
                    "parallelism_config_cp_size": 2,
                    "parallelism_config_cp_comm_strategy": "zigzag",
                },
            },
            "cp_comm_strategy='zigzag' is not a method",
        ),
        (
            {"distributed_type": "FSDP", "parallelism_config": {"parallelism_config_pp_size": 2}},
            "parallelism_config: 'parallelism_config_pp_size' is not a setting",
        ),
        (
            {"distributed_type": "FSDP", "fsdp_config": {"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP"}},
            "fsdp_auto_wrap_policy: SIZE_BASED_WRAP is not supported",
        ),
        (
            {"distributed_type": "FSDP", "fsdp_config": {"fsdp_sharding_strategy": "NO_SHARD"}},
            "NO_SHARD means no sharding",
        ),
        (
            {"distributed_type": "FSDP", "fsdp_config": {"fsdp_ignored_modules": "x"}},
            "'fsdp_ignored_modules' is not supp",
        ),
        (
            {"distributed_type": "FSDP", "num_processes": 6, "num_machines": 4},
            "does not split evenly over num_machines",
        ),
        ({"distributed_type": "FSDP", "fsdp_config": {"fsdp_offload_params": "maybe"}}, "must be true or false"),
        (
            {"distributed_type": "FSDP", "parallelism_config": {"parallelism_config_cp_size": "two"}},
            "cp_size='two' must be a whole number",
        ),
        ({"distributed_type": "FSDP", "num_processes": "eight"}, "num_processes: 'eight' must be a whole number"),
        ({"distributed_type": "FSDP", "fsdp_version": "two"}, "fsdp_version: two is not a version"),
        ({"distributed_type": "FSDP", "learning_rate": 1}, "'learning_rate' is not a setting of an Accelerate config"),
    ],
)
def test_what_cannot_be_honoured_is_one_line_naming_it(accelerate, message):
    with pytest.raises(ConfigError, match=message) as info:
        translate(accelerate)
    assert "\n" not in str(info.value)


def test_yaml_blocks_work_like_the_file_and_conflicts_are_refused(tmp_path):
    raw, _ = merge(
        {
            **RUN,
            "parallelism_config": {"parallelism_config_tp_size": 2},
            "mixed_precision": "no",
            "fsdp_config": {"fsdp_version": 2, "fsdp_reshard_after_forward": "false"},
        }
    )
    cfg = parse_config(raw)
    assert (cfg.tensor_parallel_size, cfg.bf16, cfg.reshard_after_forward) == (2, False, False)
    # the same setting twice with two values: one line naming both places
    with pytest.raises(ConfigError, match="tensor_parallel_size: the YAML says 4 but the Accelerate config says 2"):
        merge({**RUN, "tensor_parallel_size": 4, "parallelism_config": {"parallelism_config_tp_size": 2}})
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(HSDP_TP))
    with pytest.raises(ConfigError, match="bf16: the YAML's Accelerate blocks say False but --accelerate-config says"):
        merge({**RUN, "mixed_precision": "no"}, path)


def test_sizes_come_from_yaml_then_environment_then_defaults(monkeypatch):
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_COMM_STRATEGY", "ring")
    cfg = parse_config(merge({**RUN, "context_parallel_size": 1})[0])
    assert (cfg.tensor_parallel_size, cfg.context_parallel_size, cfg.cp_comm_strategy) == (2, 1, "allgather")
    cfg = parse_config(merge(RUN)[0])
    assert (cfg.tensor_parallel_size, cfg.context_parallel_size, cfg.cp_comm_strategy) == (2, 2, "ring")
    # defaults: replicas unset (they fill what fixed sizes leave, Axolotl's rule), shards fill the rest
    assert (cfg.dp_replicate_size, cfg.dp_shard_size) == (None, -1)
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "two")
    with pytest.raises(ConfigError, match="PARALLELISM_CONFIG_DP_SHARD_SIZE='two' is not an integer"):
        merge(RUN)


def test_validate_lays_out_the_run_from_an_accelerate_file(tmp_path, capsys):
    run, accelerate = tmp_path / "run.yaml", tmp_path / "accelerate.yaml"
    run.write_text(yaml.safe_dump(RUN))
    accelerate.write_text(
        yaml.safe_dump({**HSDP_TP, "fsdp_config": {**HSDP_TP["fsdp_config"], "fsdp_backward_prefetch": "BACKWARD_PRE"}})
    )
    assert main(["validate", str(run), "--accelerate-config", str(accelerate)]) == 0
    out = capsys.readouterr().out
    assert "world 8 = dp_replicate 2 x dp_shard 2 x cp 1 x tp 2" in out and "config OK for 8 process(es)" in out
    assert "not used from the Accelerate config: fsdp_backward_prefetch (FSDP2 prefetches" in out


def test_validate_takes_sizes_from_the_environment(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump(RUN))
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_COMM_STRATEGY", "alltoall")
    assert main(["validate", str(run), "--world-size", "4"]) == 0
    assert "world 4 = dp_replicate 1 x dp_shard 2 x cp 2 x tp 1 (cp method: alltoall)" in capsys.readouterr().out


def test_a_missing_accelerate_file_is_one_line(tmp_path, capsys):
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump(RUN))
    assert main(["validate", str(run), "--accelerate-config", str(tmp_path / "nope.yaml")]) == 2
    assert "--accelerate-config" in capsys.readouterr().err


def test_train_launches_what_the_accelerate_file_says(tmp_path, monkeypatch):
    from ndparallel import cli

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    run, accelerate = tmp_path / "run.yaml", tmp_path / "accelerate.yaml"
    run.write_text(yaml.safe_dump(RUN))
    accelerate.write_text(
        yaml.safe_dump(
            {
                **HSDP_TP,
                "num_processes": 16,
                "num_machines": 2,
                "machine_rank": 1,
                "main_process_ip": "head",
                "main_process_port": 29400,
            }
        )
    )
    launched = {}
    monkeypatch.setattr(cli, "_launch", lambda cfg, args: launched.update(cfg=cfg, args=args) or 0)
    assert main(["train", str(run), "--accelerate-config", str(accelerate), "--node-rank", "0"]) == 0
    cfg, args = launched["cfg"], launched["args"]
    assert (cfg.dp_replicate_size, cfg.dp_shard_size, cfg.tensor_parallel_size, cfg.context_parallel_size) == (
        2,
        2,
        2,
        1,
    )
    assert (cfg.bf16, cfg.ac_mode, cfg.reshard_after_forward) == (True, "full", False)
    assert (args.nproc_per_node, args.nnodes, args.rdzv_endpoint) == (8, 2, "head:29400")
    assert args.node_rank == 0  # the command line's own flag wins
    # The workers read the resolved config the launcher writes: environment variables no longer change it.
    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(yaml.safe_dump(cfg.model_dump(mode="json", by_alias=False)))
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "8")
    again = parse_config(cli._load_raw(str(resolved), [])[0])
    assert again.tensor_parallel_size == 2


def test_a_config_file_written_by_accelerate_config(tmp_path, capsys):
    """The file ``accelerate config`` writes (Accelerate's own ClusterConfig.to_yaml_file), with its
    ``parallelism_config:`` block, lays out the run as Accelerate would."""
    from accelerate.commands.config.config_args import ClusterConfig

    accelerate = tmp_path / "default_config.yaml"
    ClusterConfig(
        compute_environment="LOCAL_MACHINE",
        distributed_type="FSDP",
        mixed_precision="no",
        use_cpu=True,
        debug=False,
        num_processes=8,
        fsdp_config={"fsdp_version": 2, "fsdp_reshard_after_forward": True},
        parallelism_config={
            "parallelism_config_dp_replicate_size": 2,
            "parallelism_config_dp_shard_size": 2,
            "parallelism_config_tp_size": 1,
            "parallelism_config_cp_size": 2,
            "parallelism_config_cp_comm_strategy": "alltoall",
        },
    ).to_yaml_file(accelerate)
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump(RUN))
    assert main(["validate", str(run), "--accelerate-config", str(accelerate)]) == 0
    out = capsys.readouterr().out
    assert "world 8 = dp_replicate 2 x dp_shard 2 x cp 2 x tp 1" in out and "alltoall" in out
