"""Real meshes on gloo: the mesh ndparallel builds answers to every name Accelerate 1.15's mesh answers to,
with the same rank groups, and a script written against Accelerate's ParallelismConfig runs unchanged."""

from __future__ import annotations

import warnings

import accelerate.parallelism_config as acc_pc
import torch
import torch.distributed as dist

import ndparallel as ndp
from ndparallel.mesh.layout import AXES, VIEWS
from ndparallel.testing.ranks import run_ranks

# Sizes that together cover every axis and every flattened view, on 8 ranks. One comment per row.
LAYOUTS = [
    dict(dp_replicate_size=2, dp_shard_size=2, tp_size=2, cp_size=1),  # HSDP + TP
    dict(dp_replicate_size=1, dp_shard_size=2, tp_size=2, cp_size=2),  # FSDP + CP + TP
    dict(dp_replicate_size=2, dp_shard_size=2, tp_size=1, cp_size=2),  # HSDP + CP
    dict(dp_replicate_size=8, dp_shard_size=1, tp_size=1, cp_size=1),  # DDP
]


def _ranks(mesh) -> list[int]:
    return dist.get_process_group_ranks(mesh.get_group())


def _compare_meshes() -> list[dict]:
    warnings.simplefilter("ignore")  # torch's notice about slicing flattened names from the root mesh
    report = []
    for sizes in LAYOUTS:
        theirs_config, ours_config = acc_pc.ParallelismConfig(**sizes), ndp.ParallelismConfig(**sizes)
        theirs = theirs_config.build_device_mesh("cpu")
        ours = ours_config.build_device_mesh("cpu")
        # the names Accelerate's mesh answers to: its enabled dims and the flattened views it made
        names = [name for name in (*theirs.mesh_dim_names, *VIEWS) if _has(theirs, name)]
        same = {name: _ranks(theirs[name]) == _ranks(ours[name]) for name in names}
        # every name answers on ours (also the size-1 dims Accelerate leaves out), with the predicted groups
        layout = ours_config.topology.layout
        predicted = {name: _ranks(ours[name]) in layout.groups(name) for name in (*AXES, *VIEWS)}
        fsdp_mesh = ours_config.topology.fully_shard_mesh.mesh.tolist()
        report.append(
            {
                "same": same,
                "predicted": predicted,
                "fsdp_mesh": fsdp_mesh,
                "their_fsdp_mesh": theirs[tuple(theirs_config.fsdp_dim_names)].mesh.tolist()
                if _has(theirs, "dp_shard_cp")
                else None,
                "again": ours_config.get_device_mesh("cpu") is ours,
            }
        )
    return report


def _has(mesh, name: str) -> bool:
    try:
        mesh[name]
        return True
    except KeyError:
        return False


def test_rank_groups_equal_accelerates():
    for rank_report in run_ranks(8, _compare_meshes):
        for sizes, row in zip(LAYOUTS, rank_report):
            assert row["same"] and all(row["same"].values()), (sizes, row["same"])
            assert all(row["predicted"].values()), (sizes, row["predicted"])
            assert row["again"], "a second get_device_mesh must return the same mesh"
            if row["their_fsdp_mesh"] is not None:
                assert row["fsdp_mesh"] == row["their_fsdp_mesh"], sizes


def accelerate_style_script(config_class, *, sizes: dict) -> dict:
    """What Accelerate's nd_parallel example does with its ParallelismConfig, written against the class given."""
    warnings.simplefilter("ignore")
    config = config_class(**sizes)
    wants_fsdp = config.dp_shard_enabled or config.cp_enabled
    mesh = config.get_device_mesh("cpu")
    loss_group = mesh["dp_cp"].get_group() if config.dp_cp_dim_names else None
    loss = torch.tensor(float(dist.get_rank()))
    dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=loss_group)
    tp_ranks = _ranks(mesh["tp"]) if config.tp_enabled else None
    return {
        "wants_fsdp": wants_fsdp,
        "loss": loss.item(),
        "tp_ranks": tp_ranks,
        "tokens_per_device_divisor": config.non_data_parallel_size,
        "total": config.total_size,
        "fsdp_dims": config.fsdp_dim_names,
        "active": config.active_mesh_dims,
    }


def _both_scripts(sizes: dict) -> tuple[dict, dict]:
    return (
        accelerate_style_script(acc_pc.ParallelismConfig, sizes=sizes),
        accelerate_style_script(ndp.ParallelismConfig, sizes=sizes),
    )


def test_an_accelerate_script_runs_unchanged():
    sizes = dict(dp_replicate_size=1, dp_shard_size=2, tp_size=2, cp_size=2)
    for theirs, ours in run_ranks(8, _both_scripts, sizes):
        assert ours == theirs


def _all_sizes_one() -> tuple:
    theirs = acc_pc.ParallelismConfig(dp_shard_size=1).build_device_mesh("cpu")
    ours = ndp.ParallelismConfig(dp_shard_size=1).build_device_mesh("cpu")
    return theirs, tuple(ours.shape), tuple(ours.mesh_dim_names), _ranks(ours["dp_cp"])


def test_difference_a_mesh_even_when_every_size_is_one():
    theirs, shape, names, loss_ranks = run_ranks(1, _all_sizes_one)[0]
    assert theirs is None  # Accelerate: no mesh at all
    assert shape == (1, 1, 1, 1) and names == AXES and loss_ranks == [0]


def _no_sizes() -> dict:
    warnings.simplefilter("ignore")
    config = ndp.ParallelismConfig()  # no sizes: Accelerate's Accelerator makes this DDP over every process
    mesh = config.get_device_mesh("cpu")
    return {
        "dp_replicate_size": config.dp_replicate_size,
        "dp_dim_names": config.dp_dim_names,
        "accelerate_mesh": config._get_mesh(),
        "dp_ranks": _ranks(mesh["dp"]),
    }


def test_no_sizes_on_four_ranks_is_plain_data_parallelism():
    for report in run_ranks(4, _no_sizes):
        assert report == {
            "dp_replicate_size": 4,
            "dp_dim_names": ["dp_replicate"],
            "accelerate_mesh": (("dp_replicate",), (4,)),
            "dp_ranks": [0, 1, 2, 3],
        }
