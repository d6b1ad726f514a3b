"""Accelerate's launch settings for ``ndparallel train``/``validate``.

Three sources, merged into the training config before it is checked:
1. an ``accelerate config`` file (``--accelerate-config FILE``, YAML or JSON, the one ``accelerate launch
   --config_file`` reads), or its blocks written inside our YAML (``parallelism_config:``, ``fsdp_config:``,
   ``fsdp_version:``, ``mixed_precision:``);
2. the ``PARALLELISM_CONFIG_*`` environment variables (what ``accelerate launch`` exports), for sizes that
   neither the YAML nor the Accelerate config set;
3. the defaults.
A setting given both in our YAML and in the Accelerate config must agree (else a one-line error naming
both). What an Accelerate setting cannot mean here is an error that says so; settings that do not change
the trained model and have no counterpart are reported once as "not used".
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ndparallel.errors import ConfigError
from ndparallel.mesh.parallelism_config import ENV_PREFIX, ParallelismConfig, env_size
from ndparallel.safe_io import bounded_yaml

# Sizes: Accelerate's name -> the training config's field (and the alias our YAML also accepts).
SIZE_FIELDS = {
    "dp_replicate_size": ("dp_replicate_size",),
    "dp_shard_size": ("dp_shard_size",),
    "tp_size": ("tensor_parallel_size", "tp_size"),
    "cp_size": ("context_parallel_size", "cp_size"),
}

# Top-level keys of an Accelerate cluster config that only concern its own launcher or other hardware.
_LAUNCHER_ONLY = {
    "compute_environment",
    "debug",
    "downcast_bf16",
    "enable_cpu_affinity",
    "gpu_ids",
    "main_training_function",
    "rdzv_backend",
    "same_network",
    "tpu_name",
    "tpu_zone",
    "tpu_use_cluster",
    "tpu_use_sudo",
    "command_file",
    "commands",
    "tpu_vm",
    "tpu_env",
    "mpirun_config",
}
# Blocks that, when not empty, ask for something ndparallel does not run.
_REFUSED_BLOCKS = {"deepspeed_config": "DeepSpeed", "megatron_lm_config": "Megatron-LM", "fp8_config": "FP8 training"}
_DISTRIBUTED_TYPES = {"NO", "MULTI_CPU", "MULTI_GPU", "FSDP"}

# fsdp_config keys (without their optional ``fsdp_`` prefix) that need no translation: what they ask for is
# what ndparallel always does, or they tune FSDP1 internals FSDP2 does not have.
_FSDP_NOT_USED = {
    "backward_prefetch": "FSDP2 prefetches the next unit by itself",
    "forward_prefetch": "FSDP2 prefetches the next unit by itself",
    "use_orig_params": "FSDP2 keeps the original parameters",
    "transformer_layer_cls_to_wrap": "ndparallel wraps every decoder layer of the model",
    "min_num_params": "only used by SIZE_BASED_WRAP",
}
_FSDP_SILENT = {"cpu_ram_efficient_loading", "sync_module_states"}  # each rank always reads only its slices
_RESHARD = {
    "true": True,
    "false": False,
    "full_shard": True,
    "hybrid_shard": True,
    "shard_grad_op": False,
    "no_reshard": False,
    "_hybrid_shard_zero2": False,
}


@dataclass
class AccelerateSettings:
    """What an Accelerate config says, in ndparallel's terms."""

    fields: dict[str, Any] = field(default_factory=dict)
    """Training-config fields (our names) and their values."""
    launch: dict[str, Any] = field(default_factory=dict)
    """Launcher settings: nproc_per_node, nnodes, node_rank, rdzv_endpoint, world_size."""
    not_used: list[str] = field(default_factory=list)
    """'setting (why)' for each accepted setting without effect here."""


def read_file(path: str | Path) -> dict:
    """An Accelerate config file (YAML or JSON) as a mapping."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"--accelerate-config {str(path)!r} does not exist; give the file `accelerate config` wrote "
            f"(e.g. ~/.cache/huggingface/accelerate/default_config.yaml)"
        )
    try:
        data = bounded_yaml.load(path.read_text(encoding="utf-8"), source=f"--accelerate-config {str(path)!r}")
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--accelerate-config {str(path)!r} is not valid YAML or JSON: {exc}") from None
    if not isinstance(data, dict) or "distributed_type" not in data:
        raise ConfigError(f"--accelerate-config {str(path)!r} is not an Accelerate config: it has no distributed_type")
    return data


def translate(accelerate: dict) -> AccelerateSettings:
    """Translate an Accelerate config mapping (a whole file, or the blocks found in our YAML)."""
    out = AccelerateSettings()
    for key, value in accelerate.items():
        if key in _LAUNCHER_ONLY or key in _LAUNCH_KEYS:
            continue
        if key in _REFUSED_BLOCKS:
            if value:
                raise ConfigError(
                    f"{key}: {_REFUSED_BLOCKS[key]} is not supported by ndparallel; remove the block "
                    f"(FSDP2, TP and CP are set with fsdp_config and parallelism_config)"
                )
        elif key in _TRANSLATORS:
            _TRANSLATORS[key](value, out)
        else:
            raise ConfigError(
                f"{key!r} is not a setting of an Accelerate config; remove it (Accelerate itself refuses unknown keys)"
            )
    _launch_settings(accelerate, out)
    return out


def _mixed_precision(value: Any, out: AccelerateSettings) -> None:
    value = str(value).lower() if value is not None else "no"
    if value in ("no", "fp32"):
        out.fields["bf16"] = False
    elif value == "bf16":
        out.fields["bf16"] = True
    else:
        raise ConfigError(
            f"mixed_precision: {value} is not supported; use bf16 (bf16 compute, fp32 master weights and "
            f"fp32 gradient reduction) or no"
        )


def _distributed_type(value: Any, out: AccelerateSettings) -> None:
    kind = str(value).upper()
    if kind not in _DISTRIBUTED_TYPES:
        raise ConfigError(
            f"distributed_type: {value} is not supported; use FSDP (FSDP2 with parallelism_config for "
            f"TP/CP), MULTI_GPU or MULTI_CPU (plain data parallelism)"
        )
    if kind in ("MULTI_GPU", "MULTI_CPU"):  # DDP: replicas, no sharding
        out.fields.setdefault("dp_shard_size", 1)


def _use_cpu(value: Any, out: AccelerateSettings) -> None:
    if value:
        out.fields["device"] = "cpu"


def _parallelism(block: dict, out: AccelerateSettings) -> None:
    """``parallelism_config:`` keys are ``parallelism_config_<argument>``; the bare argument names are taken too."""
    arguments = {}
    for key, value in block.items():
        name = key.removeprefix("parallelism_config_")
        if name not in (
            "dp_replicate_size",
            "dp_shard_size",
            "tp_size",
            "cp_size",
            "cp_backend",
            "cp_comm_strategy",
            "sp_size",
            "sp_backend",
            "sp_seq_length",
            "sp_seq_length_is_variable",
            "sp_attn_implementation",
        ):
            raise ConfigError(
                f"parallelism_config: {key!r} is not a setting; valid: parallelism_config_"
                f"{{dp_replicate_size, dp_shard_size, tp_size, cp_size, cp_comm_strategy, ...}}"
            )
        arguments[name] = value
    sp_only = {
        k: arguments.pop(k)
        for k in ("sp_seq_length", "sp_seq_length_is_variable", "sp_attn_implementation")
        if k in arguments
    }
    cp = arguments.get("cp_size")
    if cp is None or (isinstance(cp, int) and cp <= 1):
        arguments.pop("cp_comm_strategy", None)  # accelerate launch exports it only when cp is on
    config = ParallelismConfig(**arguments)  # the class's own checks and messages (e.g. sp_size > 1 is refused)
    for name, targets in SIZE_FIELDS.items():
        if name in arguments:
            out.fields[targets[0]] = getattr(config, name)
    if config.cp_size > 1:
        out.fields["cp_comm_strategy"] = config.cp_comm_strategy
    out.not_used += [f"parallelism_config_{k} (no DeepSpeed sequence parallelism here)" for k in sp_only]


def _fsdp(block: dict, out: AccelerateSettings) -> None:
    """``fsdp_config:`` keys with or without their ``fsdp_`` prefix (both are accepted by accelerate launch)."""
    for key, value in block.items():
        name = key.removeprefix("fsdp_")
        text = str(value).lower()
        if name == "version":
            if str(value) not in ("1", "2"):
                raise ConfigError(f"fsdp_version: {value} is not a version; use 2")
            if str(value) == "1":
                out.not_used.append("fsdp_version: 1 (FSDP2 shards the same way)")
        elif name == "activation_checkpointing":
            if _bool(key, value):
                out.fields["activation_checkpointing"] = "full"
        elif name == "offload_params":
            out.fields["cpu_offload"] = _bool(key, value)
        elif name in ("reshard_after_forward", "sharding_strategy"):
            _reshard(key, text, out)
        elif name == "auto_wrap_policy":
            wrap = {"transformer_based_wrap": "block", "no_wrap": "model"}.get(text)
            if wrap is None:
                raise ConfigError(
                    f"{key}: {value} is not supported; use TRANSFORMER_BASED_WRAP (each decoder layer) or "
                    f"NO_WRAP (the whole model), or set fsdp_wrap to a number of layers"
                )
            out.fields["fsdp_wrap"] = wrap
        elif name == "state_dict_type":
            if text != "sharded_state_dict":
                out.not_used.append(
                    f"{key}: {value} (checkpoints are always sharded; `ndparallel export` or "
                    f"export_hf: true writes the full model)"
                )
        elif name in _FSDP_NOT_USED:
            out.not_used.append(f"{key} ({_FSDP_NOT_USED[name]})")
        elif name not in _FSDP_SILENT:
            raise ConfigError(f"fsdp_config: {key!r} is not supported; remove it")


def _reshard(key: str, text: str, out: AccelerateSettings) -> None:
    if text == "no_shard":
        raise ConfigError(
            f"{key}: NO_SHARD means no sharding; use distributed_type: MULTI_GPU, or dp_shard_size: 1 "
            f"with dp_replicate_size"
        )
    if text not in _RESHARD:
        raise ConfigError(f"{key}: {text} is not a choice; use true/false (FSDP2) or FULL_SHARD/SHARD_GRAD_OP")
    if text == "hybrid_shard":
        out.not_used.append(f"{key}: HYBRID_SHARD (set parallelism_config_dp_replicate_size for replicas)")
    out.fields["reshard_after_forward"] = _RESHARD[text]


def _dynamo(block: dict, out: AccelerateSettings) -> None:
    backend = str(block.get("dynamo_backend", "no")).lower()
    if backend == "inductor":
        out.fields["torch_compile"] = True
    elif backend != "no":
        raise ConfigError(
            f"dynamo_config.dynamo_backend: {block['dynamo_backend']} is not supported; use INDUCTOR "
            f"(each decoder layer is compiled) or NO"
        )
    out.not_used += [
        f"dynamo_config.{k} (layers are compiled one by one, as with regional compilation)"
        for k in block
        if k != "dynamo_backend"
    ]


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "false"):
        return str(value).lower() == "true"
    raise ConfigError(f"{key}: {value!r} must be true or false")


_TRANSLATORS = {
    "mixed_precision": _mixed_precision,
    "distributed_type": _distributed_type,
    "use_cpu": _use_cpu,
    "parallelism_config": lambda block, out: _parallelism(block or {}, out),
    "fsdp_config": lambda block, out: _fsdp(block or {}, out),
    "fsdp_version": lambda version, out: _fsdp({"version": version}, out),
    "dynamo_config": lambda block, out: _dynamo(block or {}, out),
}
_LAUNCH_KEYS = {"num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port"}


def _count(accelerate: dict, key: str, default: int) -> int:
    value = accelerate.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}: {value!r} must be a whole number")
    return value


def _launch_settings(accelerate: dict, out: AccelerateSettings) -> None:
    machines = max(1, _count(accelerate, "num_machines", 1))
    processes = _count(accelerate, "num_processes", -1)  # -1: Accelerate's "given on the command line"
    if processes > 0:
        if processes % machines:
            raise ConfigError(f"num_processes: {processes} does not split evenly over num_machines: {machines}")
        out.launch.update(world_size=processes, nproc_per_node=processes // machines)
    if machines > 1:
        out.launch.update(nnodes=machines, node_rank=_count(accelerate, "machine_rank", 0))
        if accelerate.get("main_process_ip"):
            out.launch["rdzv_endpoint"] = (
                f"{accelerate['main_process_ip']}:{accelerate.get('main_process_port', 29500)}"
            )


# Keys of our YAML that are Accelerate blocks.
# Accelerate's blocks a training YAML may carry. ``fsdp_config``/``fsdp_version`` in the YAML are Axolotl's fields
# (translated with Axolotl's meanings in config/axolotl.py); an Accelerate file's are translated here.
YAML_BLOCKS = ("parallelism_config", "mixed_precision")


def merge(
    raw: dict, accelerate_file: str | Path | None = None, *, environ: dict[str, str] | None = None
) -> tuple[dict, AccelerateSettings]:
    """The training config ``raw`` with the Accelerate settings and ``PARALLELISM_CONFIG_*`` sizes merged in."""
    raw = dict(raw)
    blocks = {key: raw.pop(key) for key in YAML_BLOCKS if key in raw}
    settings = translate(blocks)
    if accelerate_file is not None:
        from_file = translate(read_file(accelerate_file))
        for name, value in from_file.fields.items():
            if name in settings.fields and settings.fields[name] != value:
                raise ConfigError(
                    f"{name}: the YAML's Accelerate blocks say {settings.fields[name]!r} but "
                    f"--accelerate-config says {value!r}; keep one"
                )
        settings.fields.update(from_file.fields)
        settings.launch, settings.not_used = from_file.launch, settings.not_used + from_file.not_used
    for name, value in settings.fields.items():
        ours = [alias for alias in _aliases(name) if alias in raw]
        if ours and raw[ours[0]] != value:
            raise ConfigError(
                f"{ours[0]}: the YAML says {raw[ours[0]]!r} but the Accelerate config says {value!r}; keep one"
            )
        if not ours:
            raw[name] = value
    _sizes_from_environment(raw, environ)
    return raw, settings


def _aliases(name: str) -> tuple[str, ...]:
    for targets in SIZE_FIELDS.values():
        if name in targets:
            return targets
    return (name,)


def _sizes_from_environment(raw: dict, environ: dict[str, str] | None) -> None:
    """Sizes neither the YAML nor the Accelerate config set: from ``PARALLELISM_CONFIG_*``, as Accelerate reads them."""
    for name, targets in SIZE_FIELDS.items():
        if not any(t in raw for t in targets):
            value = env_size(name.upper(), None, environ=environ)
            if value is not None:
                raw[targets[0]] = value
    cp = next((raw[t] for t in SIZE_FIELDS["cp_size"] if t in raw), 1)
    strategy = (os.environ if environ is None else environ).get(ENV_PREFIX + "CP_COMM_STRATEGY")
    if "cp_comm_strategy" not in raw and strategy and isinstance(cp, int) and cp > 1:
        raw["cp_comm_strategy"] = strategy
