"""Layout planner: which (dp_replicate, dp_shard, cp, tp) layout to train a model on, and why.

    from ndparallel.planner.gpus import GPUS
    from ndparallel.planner.hardware import Cluster
    from ndparallel.planner.plan import plan
    from ndparallel.planner.report import format_table
    from ndparallel.planner.workload import Workload

    rows = plan("llama-8b", Cluster(nodes=2, gpus_per_node=8, gpu=GPUS["h200"]),
                Workload(seq_len=131072, global_batch_tokens=1 << 20, compile=True))
    print(format_table(rows))

Modules, in the order a plan is made:

    shapes.py       ModelShape (presets of models/presets.py, HF configs) and parameter counts
    gpus.py         GPU presets (datasheet peaks, memory, links); rates.py: the fractions of them kernels reach
    hardware.py     Cluster (nodes of a GPU) and which links each axis' groups use
    workload.py     Workload (sequence, batch, precision, checkpointing, LoRA, compile, fp8, packing, sync, and the
                    long-row features: fused loss, tiled MLP, activation offload)
    candidates.py   every valid layout of a world size; per-layout knobs
    activations.py  activation bytes as this implementation keeps them (measured: testing/memory_probe.py)
    backward.py     what a layer's backward holds, stage by stage, and where in the backward it peaks
    memory.py       itemized per-GPU peak memory (and, offloading, the host's)
    comm.py         bytes per step per axis; parts.py: each kind of work in seconds; perf.py: the step
    evaluate.py     one candidate estimated (PlanRow); plan.py: ranking, best_layout; reasons.py; report.py
    probe.py        ``--measure``: this GPU's kernels timed for a model shape, cached per machine
    cli.py          ``ndparallel plan``; request.py: a training config as ``best_layout``'s arguments

A new parallel axis (expert parallelism) adds its group to ``hardware.GROUP_AXES``, its traffic to
``comm.AXIS_TRAFFIC``, what it shards to ``memory.py`` and its work to ``parts.py``.

Layer: above ``mesh``, ``models``, ``parallel`` and ``step`` (whose choices it models: offload, tiled MLP, the
attention plan, FLOPs) and ``config`` (``request.py`` reads a training config duck-typed); below ``train``.
"""
