"""Reading a config as Axolotl users write it: translate Axolotl's spellings into ndparallel's settings, and
sort every other key by the policy table (``axolotl_fields``) into not used, refused or unknown.

``read_axolotl(raw, own_keys)`` returns the settings ``TrainConfig`` validates, the errors (one line each),
the "not used" keys grouped by reason (``not_used_line`` makes the one line that reports them) and notes on
translations whose meaning differs a little from Axolotl's.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from ndparallel.config.axolotl_fields import (
    OWN_NOT_USED,
    is_placeholder,
    known_names,
    plugin_problem,
    rule_for,
)

LEFT_EMPTY = "left empty"
# Axolotl's ring_attn_func -> the CP method that exchanges keys/values the same way.
RING_ATTN_FUNCS = {"varlen_llama3": "allgather", "batch_ring": "ring", "batch_zigzag": "ring", "batch_stripe": "ring"}
EXCESS_LENGTH = {"drop": "drop", "truncate": "truncate", "raise": "error"}
EXPERT_PARALLEL_PLUGIN = "ExpertParallelPlugin"
FSDP_NOT_USED = (
    "FSDP1 option or wrapping detail: ndparallel always wraps each decoder layer with FSDP2 and loads "
    "no full copy of the model on any rank"
)
FSDP_CONFIG_KEYS = {  # fsdp_config key (without its fsdp_ prefix) -> ndparallel setting, or None: not used
    "version": None,
    "offload_params": "cpu_offload",
    "reshard_after_forward": "reshard_after_forward",
    "activation_checkpointing": "activation_checkpointing",
    "cpu_ram_efficient_loading": None,
    "state_dict_type": None,
    "final_state_dict_type": None,
    "auto_wrap_policy": None,
    "transformer_layer_cls_to_wrap": None,
    "sync_module_states": None,
    "use_orig_params": None,
    "limit_all_gathers": None,
    "backward_prefetch": None,
    "forward_prefetch": None,
    "cpu_offload_pin_memory": None,
    "mixed_precision_policy": None,
    "min_num_params": None,
    "sharding_strategy": None,
    "activation_cpu_offload": None,
}


@dataclass
class Reading:
    settings: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    not_used: dict[str, list[str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def skip(self, name: str, why: str) -> None:
        self.not_used.setdefault(why, []).append(name)


def read_axolotl(raw: dict[str, Any], own_keys: set[str], dataset_keys: set[str]) -> Reading:
    """Sort the keys of ``raw`` (see the module docstring); ``own_keys`` are TrainConfig's settings."""
    reading = Reading()
    translators = {
        "fsdp": _fsdp_list,
        "fsdp_version": _fsdp_version,
        "fsdp_config": _fsdp_config,
        "ring_attn_func": _ring_attn_func,
        "sequence_parallel_degree": _sequence_parallel_degree,
        "bfloat16": _bfloat16,
        "float16": _float16,
        "excess_length_strategy": _excess_length,
        "overrides_of_model_config": _model_overrides,
        "model_config": _model_overrides,
        "model_revision": _model_revision,
        "ddp_timeout": _ddp_timeout,
        "plugins": _plugins,
        "liger_fused_linear_cross_entropy": _fused_cross_entropy,
        "cut_cross_entropy": _fused_cross_entropy,
    }
    later = []
    for key, value in raw.items():
        if key in translators:
            later.append((key, value))
        elif key in own_keys:
            value = _as_axolotl_means(reading, key, value)
            if value is not None:  # null is Axolotl's "unset": the default applies
                reading.settings[key] = value
            if key in OWN_NOT_USED and not is_placeholder(value):
                reading.skip(key, OWN_NOT_USED[key])
        else:
            _sort_other(reading, str(key), value, own_keys)
    for key, value in later:  # after the own settings: an explicit own setting wins over a translation
        if not is_placeholder(value):
            translators[key](reading, value)
        elif key != "plugins":
            reading.skip(key, LEFT_EMPTY)
    if isinstance(reading.settings.get("datasets"), list):
        reading.settings["datasets"] = [
            _dataset_entry(reading, i, entry, dataset_keys) for i, entry in enumerate(reading.settings["datasets"])
        ]
    if isinstance(reading.settings.get("pretraining_dataset"), list):  # nulls are unset there too
        reading.settings["pretraining_dataset"] = [
            {k: v for k, v in entry.items() if v is not None} if isinstance(entry, dict) else entry
            for entry in reading.settings["pretraining_dataset"]
        ]
    return reading


def _as_axolotl_means(reading: Reading, key: str, value: Any) -> Any:
    """Values Axolotl reads otherwise than their YAML type says: ``save_strategy: no`` unquoted (YAML 1.1 reads
    false), ``evals_per_epoch: 0`` (no evaluation) and ``saves_per_epoch: 0`` (no cadence of its own)."""
    if key in ("save_strategy", "eval_strategy") and value is False:
        return "no"
    if key in ("evals_per_epoch", "saves_per_epoch") and value == 0 and not isinstance(value, bool):
        if key == "evals_per_epoch" and "eval_strategy" not in reading.settings:
            reading.settings["eval_strategy"] = "no"
        return None
    return value


def _sort_other(reading: Reading, key: str, value: Any, own_keys: set[str]) -> None:
    rule = rule_for(key)
    if rule is None:
        near = difflib.get_close_matches(key, sorted(own_keys | set(known_names())), n=1, cutoff=0.75)
        hint = f"; did you mean {near[0]!r}?" if near else "; see `ndparallel validate --help-fields`"
        reading.errors.append(f"unknown setting {key!r}{hint}")
    elif rule.refuses(value):
        reading.errors.append(f"{key}: {_shown(value)} — {rule.why}")
    else:
        reading.skip(key, LEFT_EMPTY if is_placeholder(value) else rule.why)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _set_unless_given(reading: Reading, key: str, value: Any, source: str) -> None:
    """Translate into ``key`` unless the config sets ``key`` itself (then say which one wins)."""
    if key in reading.settings and reading.settings[key] != value:
        reading.notes.append(
            f"{source} says {key}={value!r} but the config sets {key}={reading.settings[key]!r}; {key} wins"
        )
        return
    reading.settings[key] = value


# --- translations ----------------------------------------------------------------------------------------


def _fsdp_list(reading: Reading, value: Any) -> None:
    options = [value] if isinstance(value, str) else list(value)
    for option in options:
        option = str(option).strip()
        if option == "offload":
            _set_unless_given(reading, "cpu_offload", True, "fsdp: [offload]")
        elif option == "shard_grad_op":
            _set_unless_given(reading, "reshard_after_forward", False, "fsdp: [shard_grad_op]")
        elif option in ("full_shard", "auto_wrap"):
            continue
        else:
            reading.skip(f"fsdp: {option}", FSDP_NOT_USED)


def _fsdp_version(reading: Reading, value: Any) -> None:
    if str(value) != "2":
        reading.skip(f"fsdp_version: {value}", FSDP_NOT_USED)


def _fsdp_config(reading: Reading, value: Any) -> None:
    if not isinstance(value, dict):
        reading.errors.append(f"fsdp_config: must be a mapping of FSDP options, got {type(value).__name__}")
        return
    for raw_key, option in value.items():
        key = str(raw_key).removeprefix("fsdp_")
        if key not in FSDP_CONFIG_KEYS:
            near = difflib.get_close_matches(key, list(FSDP_CONFIG_KEYS), n=1, cutoff=0.75)
            reading.errors.append(
                f"unknown setting fsdp_config.{raw_key}" + (f"; did you mean {near[0]!r}?" if near else "")
            )
        elif option is None:
            continue
        elif key == "version":
            _fsdp_version(reading, option)
        elif key == "sharding_strategy":
            _sharding_strategy(reading, str(option))
        elif key == "activation_checkpointing":
            if option:
                _set_unless_given(reading, "activation_checkpointing", "full", "fsdp_config.activation_checkpointing")
        elif FSDP_CONFIG_KEYS[key] is not None:
            _set_unless_given(reading, FSDP_CONFIG_KEYS[key], option, f"fsdp_config.{raw_key}")
        else:
            reading.skip(f"fsdp_config.{raw_key}", FSDP_NOT_USED)


def _sharding_strategy(reading: Reading, strategy: str) -> None:
    name = strategy.upper().split(".")[-1]
    if name == "SHARD_GRAD_OP":
        _set_unless_given(reading, "reshard_after_forward", False, "fsdp_config.sharding_strategy: SHARD_GRAD_OP")
    elif name != "FULL_SHARD":
        reading.skip(
            f"fsdp_config.sharding_strategy: {strategy}",
            "sharding strategy: set dp_replicate_size / dp_shard_size for HSDP or replication; same result",
        )


def _ring_attn_func(reading: Reading, value: Any) -> None:
    method = RING_ATTN_FUNCS.get(str(value))
    if method is None:
        reading.errors.append(f"ring_attn_func: {value!r} is not one of {', '.join(RING_ATTN_FUNCS)}")
    else:
        _set_unless_given(reading, "cp_comm_strategy", method, f"ring_attn_func: {value}")


def _sequence_parallel_degree(reading: Reading, value: Any) -> None:
    _set_unless_given(reading, "context_parallel_size", value, "sequence_parallel_degree")


def _bfloat16(reading: Reading, value: Any) -> None:
    _set_unless_given(reading, "bf16", value, "bfloat16")


def _float16(reading: Reading, value: Any) -> None:
    _set_unless_given(reading, "fp16", value, "float16")


def _excess_length(reading: Reading, value: Any) -> None:
    policy = EXCESS_LENGTH.get(str(value))
    if policy is None:
        reading.errors.append(f"excess_length_strategy: {value!r} is not one of {', '.join(EXCESS_LENGTH)}")
    else:
        _set_unless_given(reading, "long_rows", policy, "excess_length_strategy")


def _model_overrides(reading: Reading, value: Any) -> None:
    if not isinstance(value, dict):
        reading.errors.append("overrides_of_model_config: must be a mapping of config.json fields")
        return
    reading.settings["model_config_overrides"] = {**value, **reading.settings.get("model_config_overrides", {})}


def _model_revision(reading: Reading, value: Any) -> None:
    _set_unless_given(reading, "revision_of_model", value, "model_revision")


def _ddp_timeout(reading: Reading, value: Any) -> None:
    _set_unless_given(reading, "process_group_timeout_s", value, "ddp_timeout")


def _fused_cross_entropy(reading: Reading, value: Any) -> None:
    """Liger's fused linear cross-entropy and Cut Cross-Entropy: ndparallel's fused loss (on by default)."""
    if value is True:
        reading.settings.setdefault("fused_cross_entropy", True)


def _plugins(reading: Reading, value: Any) -> None:
    plugins = value if isinstance(value, list) else [value]
    for plugin in plugins:
        if str(plugin).rsplit(".", 1)[-1] == EXPERT_PARALLEL_PLUGIN:
            _expert_parallel_plugin(reading)
            continue
        problem = plugin_problem(plugin)
        if problem:
            reading.errors.append(problem)
        else:
            reading.skip(
                f"plugins: {str(plugin).rsplit('.', 1)[-1]}",
                "kernel plugin: ndparallel runs its own kernels; same result",
            )


def _expert_parallel_plugin(reading: Reading) -> None:
    """Axolotl's ExpertParallelPlugin lays out world = expert_parallel_size x dp_shard_size on two orthogonal
    axes: the experts split over ``ep``, the other weights sharded over ``dp_shard`` (one copy per ep rank), every
    rank reading its own rows. ndparallel's expert parallelism borrows its ep ranks from dp_shard instead, so
    the same run is dp_shard_size = ep x Axolotl's dp_shard_size here: the experts split ep ways and sharded over
    the rest as in Axolotl, the other weights sharded over all ranks (less memory, the same training)."""
    ep, shard = reading.settings.get("expert_parallel_size", 1), reading.settings.get("dp_shard_size")
    reading.skip(f"plugins: {EXPERT_PARALLEL_PLUGIN}", "expert parallelism is ndparallel's own (expert_parallel_size)")
    if isinstance(ep, int) and ep > 1 and isinstance(shard, int) and not isinstance(shard, bool) and shard >= 1:
        reading.settings["dp_shard_size"] = ep * shard
        reading.notes.append(
            f"{EXPERT_PARALLEL_PLUGIN}: Axolotl's world = expert_parallel_size {ep} x dp_shard_size {shard}; here "
            f"dp_shard_size {ep * shard} with the experts split {ep} ways (the non-expert weights are sharded over "
            f"all {ep * shard} ranks instead of copied per expert rank: less memory, the same training)"
        )


def _dataset_entry(reading: Reading, index: int, entry: Any, known: set[str]) -> Any:
    """One datasets[] entry: nulls dropped, Axolotl-only keys sorted by the dataset policy."""
    if not isinstance(entry, dict):
        return entry
    kept = {}
    for key, value in entry.items():
        where = f"datasets[{index}].{key}"
        if key in known:
            if value is not None:
                kept[key] = value
            continue
        rule = rule_for(str(key), dataset=True)
        if rule is None:
            near = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.6)
            hint = f"; did you mean {near[0]!r}?" if near else f"; valid: {', '.join(sorted(known))}"
            reading.errors.append(f"unknown setting {where}{hint}")
        elif rule.refuses(value):
            reading.errors.append(f"{where}: {_shown(value)} — {rule.why}")
        else:
            reading.skip(where, LEFT_EMPTY if is_placeholder(value) else rule.why)
    return kept


def not_used_line(not_used: dict[str, list[str]]) -> str | None:
    """The one line that reports every accepted-but-not-used key, grouped by reason."""
    if not not_used:
        return None
    groups = [f"{', '.join(names)} ({why})" for why, names in not_used.items() if why != LEFT_EMPTY]
    if LEFT_EMPTY in not_used:
        groups.append(f"{', '.join(not_used[LEFT_EMPTY])} ({LEFT_EMPTY})")
    return "not used: " + "; ".join(groups)
