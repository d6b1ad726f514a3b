"""Accelerate 1.15's ParallelismConfig cases (its tests/test_dataclasses.py, rewritten) run against ours, and
every documented property compared with Accelerate's own class on the same arguments.

The deliberate differences (docs/from-accelerate.md, "Deliberate differences") each have a test here that
shows Accelerate's behaviour next to ours. The rank groups of the meshes are compared on real gloo meshes
in tests/multirank/test_accelerate_mesh.py.
"""

from __future__ import annotations

import math
import warnings
from unittest.mock import Mock

import accelerate.parallelism_config as acc_pc
import accelerate.utils as acc_utils
import pytest

import ndparallel as ndp
from ndparallel import LayoutError
from ndparallel.mesh.layout import AXES

# (dp_replicate, dp_shard, tp, cp) -> the enabled mesh dims and their sizes, in mesh order; one comment per row.
LAYOUTS = [
    ((8, 1, 1, 1), ("dp_replicate",), (8,)),  # DDP
    ((1, 8, 1, 1), ("dp_shard",), (8,)),  # FSDP
    ((2, 4, 1, 1), ("dp_replicate", "dp_shard"), (2, 4)),  # HSDP
    ((1, 4, 2, 1), ("dp_shard", "tp"), (4, 2)),  # FSDP + TP
    ((2, 2, 2, 1), ("dp_replicate", "dp_shard", "tp"), (2, 2, 2)),  # HSDP + TP
    ((1, 1, 8, 1), ("tp",), (8,)),  # TP alone
    ((1, 1, 1, 4), ("cp",), (4,)),  # CP alone
    ((1, 4, 1, 2), ("dp_shard", "cp"), (4, 2)),  # FSDP + CP
    ((1, 2, 2, 2), ("dp_shard", "cp", "tp"), (2, 2, 2)),  # FSDP + CP + TP
    ((2, 2, 2, 2), ("dp_replicate", "dp_shard", "cp", "tp"), (2, 2, 2, 2)),  # HSDP + CP + TP
]

PROPERTIES = [
    "dp_replicate_size",
    "dp_shard_size",
    "tp_size",
    "cp_size",
    "cp_backend",
    "sp_size",
    "sp_backend",
    "dp_dim_names",
    "non_dp_dim_names",
    "dp_shard_cp_dim_names",
    "dp_cp_dim_names",
    "fsdp_dim_names",
    "active_mesh_dims",
    "total_size",
    "non_data_parallel_size",
    "data_parallel_size",
    "dp_replicate_enabled",
    "dp_shard_enabled",
    "tp_enabled",
    "cp_enabled",
    "sp_enabled",
]


def _sizes(row):
    r, s, t, c = row
    return dict(dp_replicate_size=r, dp_shard_size=s, tp_size=t, cp_size=c)


@pytest.fixture(autouse=True)
def _no_parallelism_env(monkeypatch):
    for name in (
        "DP_REPLICATE_SIZE",
        "DP_SHARD_SIZE",
        "TP_SIZE",
        "CP_SIZE",
        "CP_COMM_STRATEGY",
        "CP_BACKEND",
        "SP_SIZE",
        "SP_BACKEND",
    ):
        monkeypatch.delenv("PARALLELISM_CONFIG_" + name, raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


@pytest.mark.parametrize("row, names, shape", LAYOUTS)
def test_enabled_dims_follow_accelerates_mesh_order(row, names, shape):
    # Accelerate's mesh holds only the enabled dims; ours holds all four, in the same order, so the enabled
    # ones appear in the same order with the same sizes (and every rank group is the same: multirank test).
    layout = ndp.ParallelismConfig(**_sizes(row)).resolve(math.prod(row))
    enabled = [(axis, size) for axis, size in zip(AXES, layout.shape) if size > 1]
    assert tuple(a for a, _ in enabled) == names and tuple(s for _, s in enabled) == shape


@pytest.mark.parametrize("row", [r for r, _, _ in LAYOUTS])
def test_every_property_equals_accelerates(row):
    ours, theirs = ndp.ParallelismConfig(**_sizes(row)), acc_pc.ParallelismConfig(**_sizes(row))
    for name in PROPERTIES:
        assert getattr(ours, name) == getattr(theirs, name), name
    # the handlers Accelerate creates for enabled axes exist here too, with the same settings
    assert (ours.tp_handler is None) == (theirs.tp_handler is None)
    assert (ours.cp_handler is None) == (theirs.cp_handler is None)
    if ours.cp_handler is not None:
        assert ours.cp_handler.cp_comm_strategy == theirs.cp_handler.cp_comm_strategy == "allgather"


@pytest.mark.parametrize("row", [r for r, _, _ in LAYOUTS])
def test_sizes_from_environment(monkeypatch, row):
    for name, value in _sizes(row).items():
        monkeypatch.setenv("PARALLELISM_CONFIG_" + name.upper(), str(value))
    ours, theirs = ndp.ParallelismConfig(), acc_pc.ParallelismConfig()
    for name, value in _sizes(row).items():
        assert getattr(ours, name) == getattr(theirs, name) == value


def test_explicit_arguments_win_over_environment(monkeypatch):
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "4")
    assert ndp.ParallelismConfig(tp_size=2).tp_size == acc_pc.ParallelismConfig(tp_size=2).tp_size == 2


@pytest.mark.parametrize("handler_class", [ndp.TorchContextParallelConfig, acc_utils.TorchContextParallelConfig])
@pytest.mark.parametrize("method", ["allgather", "alltoall"])
def test_cp_handler_object_sets_the_method(handler_class, method):
    config = ndp.ParallelismConfig(dp_shard_size=1, cp_size=2, cp_handler=handler_class(cp_comm_strategy=method))
    assert config.cp_handler.cp_comm_strategy == method
    assert config.cp_comm_strategy == method and config.resolve(2).cp_comm_strategy == method


def test_cp_handler_as_dict():
    config = ndp.ParallelismConfig(cp_size=2, cp_handler={"cp_comm_strategy": "alltoall"})
    assert isinstance(config.cp_handler, ndp.TorchContextParallelConfig)
    assert config.cp_comm_strategy == "alltoall"
    with pytest.raises(LayoutError, match="cp_handler has no setting 'ring_size'; it takes cp_comm_strategy"):
        ndp.ParallelismConfig(cp_size=2, cp_handler={"ring_size": 2})


@pytest.mark.parametrize("method", ["allgather", "alltoall"])
def test_cp_method_from_environment_when_cp_is_enabled(monkeypatch, method):
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_COMM_STRATEGY", method)
    ours, theirs = ndp.ParallelismConfig(cp_size=2), acc_pc.ParallelismConfig(cp_size=2)
    assert ours.cp_handler.cp_comm_strategy == theirs.cp_handler.cp_comm_strategy == method


@pytest.mark.parametrize("method", ["invalid", "unsupported"])
def test_invalid_cp_method_is_a_value_error_naming_it(monkeypatch, method):
    for make in (ndp.TorchContextParallelConfig, acc_utils.TorchContextParallelConfig):
        with pytest.raises(ValueError, match=method):
            make(cp_comm_strategy=method)
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_COMM_STRATEGY", method)
    with pytest.raises(ValueError, match=f"cp_comm_strategy='{method}' is not a method; choose one of"):
        ndp.ParallelismConfig(cp_size=2)
    # As in Accelerate, the variable is not read while CP is off.
    assert ndp.ParallelismConfig(cp_size=1).cp_handler is acc_pc.ParallelismConfig(cp_size=1).cp_handler is None


def test_cp_method_shortcut_and_handler_must_agree():
    with pytest.raises(
        LayoutError, match="cp_comm_strategy='ring' and cp_handler.cp_comm_strategy='alltoall' disagree"
    ):
        ndp.ParallelismConfig(cp_size=2, cp_comm_strategy="ring", cp_handler={"cp_comm_strategy": "alltoall"})


@pytest.mark.parametrize(
    "handler", [acc_utils.TorchTensorParallelConfig(), ndp.TorchTensorParallelConfig(), {"enable_async_tp": False}]
)
def test_tp_handler_is_accepted_in_every_form(handler):
    assert ndp.ParallelismConfig(tp_size=2, tp_handler=handler).tp_handler.enable_async_tp is False


def test_async_tp_is_ignored_with_a_warning_as_in_accelerate():
    for make in (ndp.TorchTensorParallelConfig, acc_utils.TorchTensorParallelConfig):
        with pytest.warns(UserWarning, match="(?i)async"):
            make(enable_async_tp=True)
    with pytest.warns(UserWarning, match="enable_async_tp=True is ignored"):
        ndp.ParallelismConfig(tp_size=2, tp_handler={"enable_async_tp": True})


def test_a_handler_of_another_kind_is_refused():
    with pytest.raises(LayoutError, match="cp_handler must be a TorchContextParallelConfig"):
        ndp.ParallelismConfig(cp_size=2, cp_handler=acc_utils.TorchTensorParallelConfig())


def test_a_handler_for_an_axis_that_is_off_is_kept_and_ignored_with_a_warning():
    handler = acc_utils.DeepSpeedSequenceParallelConfig()
    assert handler.sp_seq_length_is_variable is True
    with pytest.warns(UserWarning, match="sp_handler is set but sp_size is 1; the handler is ignored"):
        assert ndp.ParallelismConfig(sp_handler=handler).sp_handler is handler
    with pytest.warns(UserWarning, match="cp_handler is set but cp_size is 1"):
        ndp.ParallelismConfig(cp_handler={"cp_comm_strategy": "ring"})


@pytest.mark.parametrize(
    "sizes, message",
    [
        (dict(tp_size=0), "tp_size=0 must be a whole number >= 1"),
        (dict(cp_size=-2), "cp_size=-2 must be a whole number >= 1"),
        (dict(dp_replicate_size=0), "dp_replicate_size=0 must be a whole number >= 1"),
        (dict(dp_shard_size=0), "dp_shard_size=0 must be >= 1, or -1"),
        (dict(sp_size=0), "sp_size=0 must be a whole number >= 1"),
        (dict(cp_backend="ring"), "cp_backend='ring' is not a backend"),
        (dict(sp_backend="megatron"), "sp_backend='megatron' is not a backend"),
    ],
)
def test_invalid_arguments_are_value_errors_in_both(sizes, message):
    with pytest.raises(ValueError):
        acc_pc.ParallelismConfig(**sizes)
    with pytest.raises(LayoutError, match=message):
        ndp.ParallelismConfig(**sizes)


def test_to_json_is_plain_data():
    data = ndp.ParallelismConfig(tp_size=2, cp_size=2, cp_handler={"cp_comm_strategy": "alltoall"}).to_json()
    assert data["cp_handler"] == {"cp_comm_strategy": "alltoall"} and data["tp_handler"] == {"enable_async_tp": False}
    assert data["tp_size"] == 2 and data["cp_comm_strategy"] == "alltoall"
    # Accelerate's to_json builds the same copy and returns nothing (difference 8 in the table).
    assert acc_pc.ParallelismConfig(tp_size=2).to_json() is None


def test_get_device_mesh_needs_a_device_type_the_first_time():
    with pytest.raises(ValueError, match="device_type"):
        acc_pc.ParallelismConfig().get_device_mesh()
    with pytest.raises(LayoutError, match=r"get_device_mesh\(\) needs device_type"):
        ndp.ParallelismConfig().get_device_mesh()


# --- the deliberate differences, each next to Accelerate's behaviour -------------------------------------


def test_difference_dp_shard_defaults_to_fill_the_world(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    ours, theirs = ndp.ParallelismConfig(tp_size=2), acc_pc.ParallelismConfig(tp_size=2)
    assert theirs.dp_shard_size == 1 and theirs.total_size == 2  # Accelerate: a mismatch with 8 processes
    assert ours.dp_shard_size == -1 and ours.total_size == 8  # ours: FSDP over the 4 ranks tp leaves
    assert ours.dp_shard_enabled and ours.dp_dim_names == ["dp_shard"] and ours.resolve(8).shape == (1, 4, 1, 2)
    # explicit sizes mean the same thing in both
    assert ndp.ParallelismConfig(dp_shard_size=1, tp_size=2).total_size == 2


def test_difference_tp_or_cp_with_plain_replicas_is_allowed():
    for sizes in (
        dict(dp_replicate_size=2, dp_shard_size=1, tp_size=2),
        dict(dp_replicate_size=2, cp_size=2, dp_shard_size=1),
    ):
        with pytest.raises(ValueError, match="pure data parallelism"):
            acc_pc.ParallelismConfig(**sizes)
        assert ndp.ParallelismConfig(**sizes).resolve(4).shape in ((2, 1, 1, 2), (2, 1, 2, 1))


def test_difference_ring_is_a_cp_method():
    with pytest.raises(ValueError, match="Invalid cp_comm_strategy: ring"):
        acc_utils.TorchContextParallelConfig(cp_comm_strategy="ring")
    assert ndp.ParallelismConfig(cp_size=2, cp_handler={"cp_comm_strategy": "ring"}).cp_comm_strategy == "ring"


def test_difference_deepspeed_sequence_parallelism_is_refused():
    theirs = acc_pc.ParallelismConfig(
        sp_backend="deepspeed", sp_size=2, sp_handler=acc_utils.DeepSpeedSequenceParallelConfig()
    )
    assert theirs.sp_enabled and theirs.total_size == 2
    with pytest.raises(
        LayoutError,
        match="sp_size=2 asks for DeepSpeed's ALST/Ulysses sequence parallelism.*use "
        "cp_size=2 with cp_comm_strategy='alltoall'",
    ):
        ndp.ParallelismConfig(sp_backend="deepspeed", sp_size=2)


def test_sizes_all_one_on_several_ranks_mean_plain_data_parallelism():
    # Accelerate turns a config of total size 1 into DDP over every process when its Accelerator starts;
    # here the same happens when the layout is resolved (and the config's sizes follow once a mesh is built).
    assert ndp.ParallelismConfig(dp_shard_size=1).resolve(8).shape == (8, 1, 1, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(LayoutError, match="= 4, but 8 processes were started"):
            ndp.ParallelismConfig(dp_shard_size=2, tp_size=2).resolve(8)


# --- Accelerate's own test cases and tools, run against ours as a user switching would -----------------

# Accelerate's tests/test_dataclasses.py::TestParallelismConfig::test_get_mesh table: its view of the mesh.
ACCELERATE_MESHES = [
    ((8, 1, 1, 1), (8,), ("dp_replicate",)),  # DDP
    ((1, 8, 1, 1), (8,), ("dp_shard",)),  # FSDP
    ((2, 4, 1, 1), (2, 4), ("dp_replicate", "dp_shard")),  # HSDP
    ((1, 4, 2, 1), (4, 2), ("dp_shard", "tp")),  # FSDP + TP
    ((2, 2, 2, 1), (2, 2, 2), ("dp_replicate", "dp_shard", "tp")),  # HSDP + TP
    ((1, 1, 8, 1), (8,), ("tp",)),  # TP only
    ((1, 1, 1, 4), (4,), ("cp",)),  # CP only
    ((1, 4, 1, 2), (4, 2), ("dp_shard", "cp")),  # FSDP + CP
    ((1, 2, 2, 2), (2, 2, 2), ("dp_shard", "cp", "tp")),  # FSDP + CP + TP
    ((2, 2, 2, 2), (2, 2, 2, 2), ("dp_replicate", "dp_shard", "cp", "tp")),  # HSDP + CP + TP
]


@pytest.mark.parametrize("row, shape, names", ACCELERATE_MESHES)
def test_accelerates_get_mesh_cases(row, shape, names):
    ours, theirs = ndp.ParallelismConfig(**_sizes(row)), acc_pc.ParallelismConfig(**_sizes(row))
    assert ours._get_mesh() == theirs._get_mesh() == (names, shape)


def test_no_sizes_on_n_processes_is_plain_data_parallelism_as_in_accelerate(monkeypatch):
    """``ParallelismConfig()`` on 8 processes: Accelerate's Accelerator makes it DDP over the 8; so do we (it
    was FSDP over the 8 here). Before the mesh both read total_size 1, as Accelerate does."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    ours, theirs = ndp.ParallelismConfig(), acc_pc.ParallelismConfig()
    for name in PROPERTIES:
        assert getattr(ours, name) == getattr(theirs, name), name
    accelerator = Mock(multi_device=True, num_processes=8, is_fsdp2=False, distributed_type="MULTI_CPU")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs._validate_accelerator(accelerator)
    layout = ours.resolve(8)
    assert (layout.dp_replicate, layout.dp_shard) == (theirs.dp_replicate_size, theirs.dp_shard_size) == (8, 1)


@pytest.mark.parametrize("row", [r for r, _, _ in ACCELERATE_MESHES])
def test_the_environment_accelerate_launch_writes(monkeypatch, row):
    """The PARALLELISM_CONFIG_* variables exactly as ``accelerate launch --use_parallelism_config`` writes them
    (Accelerate's own parser and function), read by both classes."""
    from accelerate.commands.launch import launch_command_parser
    from accelerate.utils.launch import prepare_extend_env_parallelism_config

    r, s, t, c = row
    argv = ["--use_parallelism_config", "--parallelism_config_dp_replicate_size", str(r)]
    argv += ["--parallelism_config_dp_shard_size", str(s), "--parallelism_config_tp_size", str(t)]
    argv += ["--parallelism_config_cp_size", str(c), "--parallelism_config_cp_comm_strategy", "alltoall", "x.py"]
    env = prepare_extend_env_parallelism_config(launch_command_parser().parse_args(argv), {})
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    ours, theirs = ndp.ParallelismConfig(), acc_pc.ParallelismConfig()
    for name in PROPERTIES:
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.resolve(math.prod(row)).shape == (r, s, c, t)
    if c > 1:
        assert ours.cp_comm_strategy == theirs.cp_handler.cp_comm_strategy == "alltoall"


@pytest.mark.parametrize(
    "make",
    [
        lambda: ndp.ParallelismConfig(tp_size=0),
        lambda: ndp.ParallelismConfig(tp_size="2"),
        lambda: ndp.ParallelismConfig(cp_size=2, cp_handler="ring"),
        lambda: ndp.ParallelismConfig(cp_size=2, cp_comm_strategy="zigzag"),
        lambda: ndp.ParallelismConfig(sp_size=2),
        lambda: ndp.TorchContextParallelConfig(cp_comm_strategy="invalid"),
        lambda: ndp.ParallelismConfig().get_device_mesh(),
        lambda: ndp.ParallelismConfig(tp_size=3).resolve(8),
        lambda: ndp.ParallelismConfig(tp_size=2, dp_shard_size=2).resolve(8),  # 4 ranks asked, 8 started
    ],
)
def test_every_error_a_user_can_cause_is_a_value_error(make):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError):
            make()
