"""The planner's long-row features: the fused loss, the tiled MLP and activation offload, by hand, in the knob
search, and from a training config (best_layout, the out-of-memory advice). No processes."""

import pytest
from transformers import LlamaConfig

from ndparallel import ConfigError
from ndparallel.config.reading import parse_config
from ndparallel.mesh.layout import Layout
from ndparallel.planner.activations import (
    activation_bytes,
    attention_side,
    fused_head_backward,
    fused_loss_peak,
    layer_none,
)
from ndparallel.planner.backward import attention_stage, mlp_stage, position_extra, tile_tokens
from ndparallel.planner.gpus import GPUS
from ndparallel.planner.hardware import Cluster
from ndparallel.planner.memory import offload_host_bytes, offload_layers_for
from ndparallel.planner.parts import MicroBatch, linear_s
from ndparallel.planner.plan import best_layout, plan
from ndparallel.planner.request import layout_request
from ndparallel.planner.shapes import PRESETS
from ndparallel.planner.workload import Workload
from ndparallel.train.oom import planner_advice
from ndparallel.train.setup import resolve_layout

L1B, L8B = PRESETS["llama-1b"], PRESETS["llama-8b"]
V, GIB = 128256, 2**30
H200 = Cluster(nodes=1, gpus_per_node=1, gpu=GPUS["h200"], host_memory_gib=128)


def test_the_fused_loss_keeps_the_input_gradient_and_a_float32_weight_gradient_not_the_logits():
    h, n = 4096, 8192
    fused = activation_bytes(L8B, Layout(tp=2), n, 1, "none", 2)
    unfused = activation_bytes(L8B, Layout(tp=2), n, 1, "none", 2, fused_loss=False)
    assert unfused.loss_saved == n * (2 * V / 2 + 14)  # the logits (vocabulary-split) and 14 B per token
    assert fused.loss_saved == 4 * V * h / 2  # lm_head's float32 weight gradient, not per token
    assert fused.head == unfused.head  # lm_head's input gradient instead of its input: the same e*h
    # LoRA: lm_head is frozen (no weight gradient), but the hidden states still need a gradient
    lora_f, lora_u = (activation_bytes(L8B, Layout(), n, 1, "none", 2, 16, fused_loss=f) for f in (True, False))
    assert lora_f.loss_saved == 0 and lora_f.head - lora_u.head == 2 * h * n


def test_the_fused_loss_peak_by_hand_and_on_the_h200():
    # the 1B's head, 8,192 tokens, bf16, compiled on CUDA: lm_head's input gradient, the float32 weight
    # gradient (summed in place), one chunk of 2,048 rows (~512 MiB of logits),
    # 18 B per token and 20 per chunk row
    h, n, c = 2048, 8192, 2048
    compiled = fused_loss_peak(L1B, Layout(), n, 1, 2, compiled=True)
    assert compiled == 2 * n * h + 4 * V * h + 2 * c * V + 18 * n + 20 * c
    # tests/gpu/gpu_fused_loss.py on the H200, above x and W with the previous call's bf16 gradients of W and x
    # (2*V*h + 2*n*h) still held: 3.49 GiB with 4,096-row chunks, 2.51 GiB with 2,048-row
    # chunks; both are this count with a second chunk (the loop held the previous chunk
    # while making the next; it frees it first now, which is not measured yet)
    held = 2 * V * h + 2 * n * h
    for rows, measured in ((4096, 3.49), (2048, 2.51)):
        two_chunks = 2 * n * h + 4 * V * h + 2 * 2 * rows * V + 18 * n + 20 * rows
        assert round((two_chunks + held) / GIB, 2) == measured
    # eager on CUDA: the same Triton kernels (no float32 copy of the chunk)
    assert fused_loss_peak(L1B, Layout(), n, 1, 2) == compiled
    # fp32 on CUDA: the chunk's gradient accumulates in place, no temporaries
    c32 = 1024  # ~512 MiB of float32 logits
    assert fused_loss_peak(L1B, Layout(), n, 1, 4) == 4 * n * h + 4 * V * h + 4 * c32 * V + 18 * n + 20 * c32
    # CPU (torch functions): three float32 copies of the chunk, 12 B per bf16 element, and each chunk's bf16
    # weight-gradient product in a kept buffer
    cpu_c = 256  # 64 MiB of bf16 logits at this vocabulary: the 256-row minimum
    cpu = fused_loss_peak(L1B, Layout(), n, 1, 2, device="cpu")
    assert cpu == 2 * n * h + 4 * V * h + 2 * V * h + 2 * cpu_c * V + 12 * cpu_c * V + 18 * n + 20 * cpu_c
    # lm_head's backward: the float32 gradient and its bf16 cast at once; nothing under LoRA
    assert fused_head_backward(L1B, Layout(tp=2), 2) == 6 * V * h / 2
    assert fused_head_backward(L1B, Layout(), 2, lora_rank=16) == 0


def test_the_tiled_mlp_keeps_no_mlp_tensor_and_its_input_split_over_tp():
    h, i, n, t = 4096, 14336, 8192, 2
    plain, tiled = (layer_none(L8B, Layout(tp=t), n, 1, 2, tiled=x) for x in (False, True))
    # gate, up, silu(gate), their product (4 e*i/t) go; the MLP's input is kept sequence-split, e*h/t, not gathered
    assert plain - tiled == n * (4 * 2 * i / t + 2 * h - 2 * h / t)
    # LoRA: the gate/up/down adapters' A outputs go with the tiles (2 whole, down's sequence-split)
    r = 16
    lora = layer_none(L8B, Layout(tp=t), n, 1, 2, r) - layer_none(L8B, Layout(tp=t), n, 1, 2, r, tiled=True)
    assert lora - (plain - tiled) == n * 2 * r * (2 + 1 / t)
    # selective checkpointing caches the tiles' matmul outputs (counted on CPU): tiling changes nothing there
    sel = [activation_bytes(L8B, Layout(), n, 1, "selective", tiled=x).per_layer for x in (False, True)]
    assert sel[0] == sel[1]


def test_a_layers_backward_by_stage_by_hand():
    # 1B, 131,072 tokens, full checkpointing; per token e*h = 4096, e*i = 16384
    n, h, i = 131072, 2048, 8192
    eager = activation_bytes(L1B, Layout(), n, 1, "full", compiled=False)
    compiled = activation_bytes(L1B, Layout(), n, 1, "full", compiled=True)
    # eager: the MLP's four forward tensors (in the recompute) and two gradients, the output's gradient,
    # down_proj's weight gradient (CPU-counted)
    assert mlp_stage(L1B, Layout(), n, 1, 2, eager, compiled=False, tiled=False) == (
        eager.layer_recompute + 2 * 2 * i * n + 2 * h * n + 2 * h * i
    )
    # compiled: the recompute keeps 3 of the four; 7 at once in its backward (H200)
    assert mlp_stage(L1B, Layout(), n, 1, 2, compiled, compiled=True, tiled=False) == (
        compiled.layer_recompute + 4 * 2 * i * n + 2 * h * n + 2 * h * i
    )
    # tiled: 16 tiles of 8,192 tokens (one tile's four (tile x i) tensors <= one (n x h) one)
    tiled = activation_bytes(L1B, Layout(), n, 1, "full", compiled=True, tiled=True)
    assert tile_tokens(L1B, Layout(), n, 1) == 8192 and tile_tokens(L1B, Layout(), 1 << 20, 1) == 65536
    assert mlp_stage(L1B, Layout(), n, 1, 2, tiled, compiled=True, tiled=True) == (
        tiled.layer_recompute + 7 * 2 * i * 8192 + 2 * h * n + 2 * h * (n - 8192) + 3 * 2 * h * i
    )
    # attention: its recomputed half (compiled norm 4 + e*h, q/k/v input e*h, q, k, v, output, lse), the
    # residual and output gradients, FlashAttention 2's float32 dQ, dQ, dK and dV per query head and summed
    per_token = (4 + 4096) + 4096 + (2 * (2 * 2048 + 2 * 512) + 4 * 32)
    per_token += 4096 + 4096 + 4 * 2048 + 4096 + 2 * 2 * 2048 + 2 * 2 * 512
    assert (
        attention_stage(L1B, Layout(), n, 1, 2, tiled, "full", compiled=True)
        == n * per_token
        == (attention_side(L1B, Layout(), n, 1, 2, compiled=True) + n * (4096 + 4096 + 8192 + 4096 + 8192 + 2048))
    )


def test_where_in_the_backward_offloaded_inputs_and_gradients_peak():
    p, g = 100.0, 1.0  # a layer's kept input, a finished layer's gradients
    # no offload: the first layer (all kept); later layers free more than their gradients add
    assert position_extra(16, 0, p, g) == 0
    assert position_extra(16, 0, p, 2 * p) == 15 * p  # gradients heavier than inputs: the last layer
    # 15 of 16 offloaded: the first layer holds its input and prefetches layer 14's; layer 1 holds its own and
    # layer 0's, with fourteen layers' gradients made
    assert position_extra(16, 15, p, g) == p + 14 * g
    assert position_extra(16, 15, p, 0.0) == p


def test_offload_follows_the_host_memory():
    work = Workload(seq_len=1 << 20, global_batch_rows=1, activation_offload=True)
    # 1B at 1,048,576 tokens: 4 GiB per layer input; 80% of 128 GiB holds 25, all but the last is 15
    assert offload_layers_for(L1B, Layout(), work, H200) == 15
    assert offload_layers_for(L1B, Layout(), work, Cluster(gpus_per_node=1, host_memory_gib=32)) == 6
    assert offload_host_bytes(L1B, Layout(), work, H200, 1, 15) == 15 * 4 * GIB
    # every GPU of a node offloads; pinned blocks are powers of two (100,000 tokens: 390.6 MiB -> 512 MiB)
    odd = Workload(seq_len=100_000, global_batch_rows=8, activation_offload=True)
    assert offload_host_bytes(L1B, Layout(dp_shard=8), odd, Cluster(), 1, 3) == 3 * 8 * 512 * 2**20
    assert Cluster(gpus_per_node=8, gpu=GPUS["h200"]).host_bytes == 8 * 128 * GIB


def test_workload_settings_are_checked():
    with pytest.raises(ConfigError, match="full activation checkpointing keeps: plan activation_checkpointing full"):
        Workload(seq_len=4096, global_batch_rows=1, activation_checkpointing="none", activation_offload=True)
    with pytest.raises(ConfigError, match="tiled_mlp='yes' must be true, false or 'auto'"):
        Workload(seq_len=4096, global_batch_rows=1, tiled_mlp="yes")
    with pytest.raises(ConfigError, match="host_memory_gib=0 must be > 0"):
        Cluster(host_memory_gib=0)


def _one_h200(seq: int, **work):
    return plan(
        "llama-1b", H200, Workload(seq_len=seq, global_batch_rows=1, micro_batch_sizes=(1,), compile=True, **work)
    )


def test_1b_at_1m_tokens_on_one_h200_fits_only_with_tiling_and_offload():
    for tiled, offload in ((False, False), (True, False), (False, True)):
        row = _one_h200(1 << 20, tiled_mlp=tiled, activation_offload=offload)[0]
        assert not row.fits, (tiled, offload, row.memory.total / GIB)
    best = _one_h200(1 << 20)[0]  # the planner's default: the features where nothing fits without them
    assert best.fits and best.tiled_mlp and best.offload_layers == 15 and best.activation_checkpointing == "full"
    assert any(r.startswith("tiled MLP (tiled_mlp: true)") for r in best.reasons)
    assert any("the inputs of the first 15 of 16 layers wait in host memory, 60.0 GiB" in r for r in best.reasons)
    # best_layout, for a run without them: nothing fits, and it says what to set
    layout, reason = best_layout("llama-1b", 1, 1 << 20, gpu="h200", host_memory_gib=128, compile=True)
    assert layout.world_size == 1
    assert "nothing fits as configured" in reason and "set tiled_mlp: true and activation_offloading: true" in reason
    _, on = best_layout(
        "llama-1b", 1, 1 << 20, gpu="h200", host_memory_gib=128, compile=True, tiled_mlp=True, activation_offload=True
    )
    assert "tiled_mlp=true, activation_offloading=true (15 layers)" in on and "GiB of 125.8 usable" in on


def test_the_features_stay_off_where_the_row_fits_without_them():
    best = _one_h200(8192)[0]
    assert best.fits and not best.tiled_mlp and not best.offload_layers and best.host_bytes == 0


def test_host_memory_bounds_offload():
    # host memory too small for one layer: no offload candidate, so nothing fits
    small = Cluster(nodes=1, gpus_per_node=1, gpu=GPUS["h200"], host_memory_gib=4)
    rows = plan("llama-1b", small, Workload(seq_len=1 << 20, global_batch_rows=1, micro_batch_sizes=(1,), compile=True))
    assert not rows[0].fits and not rows[0].offload_layers
    # a fixed count that does not fit in the host's memory is named
    fixed = Workload(
        seq_len=1 << 20,
        global_batch_rows=1,
        micro_batch_sizes=(1,),
        activation_offload=True,
        activation_offload_layers=15,
    )
    row = plan("llama-1b", Cluster(nodes=1, gpus_per_node=1, gpu=GPUS["h200"], host_memory_gib=16), fixed)[0]
    assert not row.host_fits and not row.fits
    assert row.reasons[0].startswith("does not fit: the inputs of 15 layers offloaded need 60.0 GiB of host memory")
    # offload asked for with a host that holds no layer (the trainer refuses such a run): said the same way
    asked = Workload(seq_len=1 << 20, global_batch_rows=1, micro_batch_sizes=(1,), activation_offload=True)
    row = plan("llama-1b", small, asked)[0]
    assert row.offload_layers == 1 and not row.host_fits
    assert row.reasons[0].startswith("does not fit: the inputs of 1 layer offloaded need 4.0 GiB of host memory")


def test_time_of_the_features():
    work = Workload(seq_len=131072, global_batch_rows=1, compile=True)
    plain = MicroBatch(L1B, Layout(), work, 1, "full")
    tiled = MicroBatch(L1B, Layout(), work, 1, "full", tiled_mlp=True)
    rates = H200.rates
    mlp = sum(rates.gemm_s(131072, out, k) for k, out in ((2048, 8192), (2048, 8192), (8192, 2048)))
    assert linear_s(tiled, rates) - linear_s(plain, rates) == pytest.approx(16 * mlp)  # one more MLP forward
    # offload: a 0.5 GiB copy (~10 ms on PCIe Gen5) hides behind a layer's forward; on a slow link it shows
    kw = dict(activation_offload=True, tiled_mlp=False)
    row = _one_h200(131072, **kw)[0]
    assert row.offload_layers == 15 and "offload" not in row.time.exposed_comm_s
    slow = Cluster(nodes=1, gpus_per_node=1, gpu=GPUS["h200"].with_overrides(host_link_gbps=1.0), host_memory_gib=128)
    row = plan("llama-1b", slow, Workload(seq_len=131072, global_batch_rows=1, compile=True, **kw))[0]
    assert row.time.exposed_comm_s["offload"] > 1.0


BASE = {"datasets": [{"path": "data.jsonl", "type": "completion"}]}


def test_a_training_config_becomes_one_planner_request():
    """#36: dp_shard_size: auto and the out-of-memory advice read the same request, compile, gradient sync and the
    long-row features included."""
    cfg = parse_config(
        {
            **BASE,
            "model_shape": "1b",
            "sequence_len": 65536,
            "micro_batch_size": 2,
            "torch_compile": True,
            "gradient_sync": "last_micro_batch",
            "gradient_checkpointing": True,
            "tiled_mlp": True,
            "tiled_mlp_num_shards": 8,
            "activation_offloading": True,
            "activation_offload_layers": 4,
            "fused_cross_entropy": False,
            "cp_comm_strategy": "ring",
        }
    )
    assert layout_request(cfg, host_memory_gib=64) == {
        "seq_len": 65536,
        "micro_batch_size": 2,
        "precision": "bf16",
        "bf16_weights": False,
        "eight_bit_optimizer": False,
        "activation_checkpointing": "full",
        "compile": True,
        "gradient_sync": "last_micro_batch",
        "cp_comm_strategy": "ring",
        "lora_rank": None,
        "quantized_base": None,
        "fused_loss": False,
        "tiled_mlp": True,
        "tiled_mlp_num_shards": 8,
        "activation_offload": True,
        "activation_offload_layers": 4,
        "embedding_offload": False,
        "host_memory_gib": 64,
    }


TINY = LlamaConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=8,
    max_position_embeddings=4096,
)


def test_dp_shard_size_auto_plans_the_runs_features():
    cfg = parse_config(
        {**BASE, "model_shape": "tiny", "sequence_len": 4096, "dp_shard_size": "auto", "gradient_checkpointing": True}
    )
    _, reason = resolve_layout(cfg, 2, TINY)
    assert "tiled_mlp" not in reason and "activation_offloading" not in reason
    on = parse_config({**cfg.model_dump(exclude_unset=True), "tiled_mlp": True, "activation_offloading": True})
    _, reason = resolve_layout(on, 2, TINY)
    assert "activation_checkpointing=full, tiled_mlp=true, activation_offloading=true (1 layer)" in reason


def test_out_of_memory_advice_names_the_features_that_would_fit(monkeypatch):
    from ndparallel.parallel import offload
    from ndparallel.weights.meta import model_config_for

    monkeypatch.setattr(offload, "host_memory_available", lambda: 128 * GIB)
    cfg = parse_config({**BASE, "model_shape": "1b", "sequence_len": 1 << 20, "gradient_checkpointing": True})
    config = model_config_for(base_model=None, model_shape="1b", overrides={}, max_position_embeddings=1 << 20)
    advice = planner_advice(cfg, config, Layout(), 139.8)
    assert "\n" not in advice and advice.startswith("the planner suggests nothing fits as configured")
    assert "set tiled_mlp: true and activation_offloading: true" in advice


def test_plan_command_takes_the_features_and_the_host_memory(capsys):
    import argparse
    import json

    from ndparallel.planner.cli import add_plan_arguments, run_plan
    from ndparallel.planner.evaluate import PlanRow

    def run(*extra):
        base = ["--model", "1b", "--gpu", "h200", "--gpus-per-node", "1", "--seq-len", "1048576", "--global-batch"]
        parser = add_plan_arguments(argparse.ArgumentParser(prog="ndparallel plan"))
        code = run_plan(parser.parse_args([*base, "1", "--micro-batch-sizes", "1", "--compile", *extra]))
        return code, capsys.readouterr().out

    code, out = run("--host-memory-gib", "128")
    assert code == 0 and "full +tiled +offload 15" in out
    assert "tiled MLP where nothing fits without, activation offload where nothing fits without" in out
    code, out = run("--tiled-mlp", "false", "--activation-offload", "false")
    assert code == 1 and "tiled MLP off, activation offload off" in out  # nothing fits: exit 1
    code, _ = run("--host-memory-gib", "128", "--unfused-loss")
    assert code == 1  # the model's logits alone: 1,048,576 x 128,256 in bf16, 250 GiB
    code, out = run("--host-memory-gib", "128", "--json")
    rows = [PlanRow.from_dict(d) for d in json.loads(out)]
    assert rows[0].tiled_mlp and rows[0].offload_layers == 15 and rows[0].host_bytes == 60 * GIB
    assert rows[0].to_dict() == json.loads(out)[0]
