"""One rank without FSDP computes what FSDP on a mesh of one computes, in bf16 mixed precision.

The fp32 path against plain PyTorch is a row of test_parity.py ("single-accum") and of
test_checkpoint.py (resume on one process). Here: bf16 compute copies, fp32 masters and gradients,
tied embeddings, two micro-batches and full activation checkpointing (the recomputation during
backward must find the compute copies), against ``single_rank_fsdp=True`` (the FSDP2 path).
"""

from __future__ import annotations

import pytest
from support.scenarios import make_batches, max_rel_diff, max_weight_diff, train_parallel

from ndparallel.testing.ranks import run_ranks


def _train(single_rank_fsdp: bool) -> dict:
    # Two steps: the optimizers order their float32 operations differently (fused flat update vs torch's),
    # ~1e-7 in the weights from the second update on; once such a difference moves a bf16 compute copy by one
    # rounding step, Adam turns it into an lr-sized step on near-zero gradients (measured: 2.4e-3 in an
    # embedding row by step 4). That is the optimizers' arithmetic, not the bf16 path under test.
    batches = make_batches(steps=2, micro=2, rows=8, seq=32, pad=True)
    options = {"param_dtype": "bfloat16", "activation_checkpointing": "full", "single_rank_fsdp": single_rank_fsdp}
    return train_parallel("llama", {"dp_shard_size": 1}, batches, model_kwargs={"tied": True}, options=options)


def test_bf16_without_fsdp_matches_fsdp_on_one_rank(parity_record):
    flat = run_ranks(1, _train, False)[0]
    fsdp = run_ranks(1, _train, True)[0]
    # Same bf16 forward and backward, same fp32 gradients: identical losses and norms.
    assert flat["losses"] == fsdp["losses"]
    assert flat["grad_norms"] == fsdp["grad_norms"]
    weight_diff, where = max_weight_diff(fsdp["weights"], flat["weights"])
    parity_record({"loss": max_rel_diff(flat["losses"], fsdp["losses"]), "weights": weight_diff})
    assert weight_diff <= 1e-6, f"weights differ by {weight_diff:.2e} in {where}"
    assert all(w.dtype.is_floating_point and w.element_size() == 4 for w in flat["weights"].values())  # fp32 masters


def _train_bf16_grads(master_grads: bool, micro: int) -> dict:
    batches = make_batches(steps=2, micro=micro, rows=8, seq=32, pad=True)
    options = {"param_dtype": "bfloat16", "activation_checkpointing": "full"}
    return train_parallel(
        "llama", {"dp_shard_size": 1}, batches, model_kwargs={"tied": True}, options=options, master_grads=master_grads
    )


@pytest.mark.parametrize("micro", [1, 2])
def test_adamw_reading_bf16_gradients_in_place_matches_fp32_gradients(micro, parity_record):
    """The trainer's one-rank mode (build_optimizer(master_grads=False): no fp32 gradient after a step's only
    micro-batch; with two, the first's are upcast at the second's forward) against fp32 .grad, on a tied,
    checkpointed bf16 model: same losses, norms to float32 rounding, weights to 1e-6."""
    in_place = run_ranks(1, _train_bf16_grads, False, micro)[0]
    fp32 = run_ranks(1, _train_bf16_grads, True, micro)[0]
    assert in_place["losses"] == fp32["losses"]
    assert in_place["grad_norms"] == pytest.approx(fp32["grad_norms"], rel=1e-6)
    weight_diff, where = max_weight_diff(fp32["weights"], in_place["weights"])
    parity_record({"loss": max_rel_diff(in_place["losses"], fp32["losses"]), "weights": weight_diff})
    assert weight_diff <= 1e-6, f"weights differ by {weight_diff:.2e} in {where}"


def _built_from_meta() -> dict:
    import torch

    import ndparallel as ndp
    from ndparallel.parallel.single_rank import single_rank_state
    from ndparallel.weights.materialize import materialize
    from ndparallel.weights.meta import meta_model, model_config_for

    topo = ndp.Topology.build(ndp.ParallelismConfig(dp_shard_size=1))
    config = model_config_for(
        base_model=None, model_shape="tiny", overrides={"tie_word_embeddings": True}, max_position_embeddings=64
    )
    model = meta_model(config)
    ndp.parallelize(model, topo, options=ndp.ParallelOptions(param_dtype="bfloat16"))
    materialize(model, topo.device, weights_dir=None, seed=0)  # to_empty makes new parameters: re-flattened
    opt = ndp.build_optimizer(model, lr=1e-3)
    batch = ndp.prepare_batch(torch.randint(0, 256, (2, 64)), topo)
    ndp.token_loss(
        model(**batch.model_inputs()).logits, batch.labels, num_tokens=batch.num_tokens.float(), topology=topo
    ).backward()
    opt.step()
    flat = single_rank_state(model)
    return {
        "flat": flat.is_flat(),
        "fused_groups": len(opt._plans),
        "compute": str(flat.compute_flat.dtype),
        "grads_in_buffer": all(p.grad.data_ptr() >= flat.grad_flat.data_ptr() for p in model.parameters()),
        # to_empty gives the head and the embeddings a tensor each; the flat buffers must keep them one
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
    }


def test_a_model_built_on_meta_trains_on_the_flat_buffers():
    got = run_ranks(1, _built_from_meta)[0]
    assert got == {"flat": True, "fused_groups": 2, "compute": "torch.bfloat16", "grads_in_buffer": True, "tied": True}


def _train_lora_from_meta(single_rank_fsdp: bool) -> dict:
    """A tied model built on meta, LoRA, bf16: where each weight is stored, and three steps' losses."""
    import torch

    import ndparallel as ndp
    from ndparallel.weights.materialize import materialize
    from ndparallel.weights.meta import meta_model, model_config_for

    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    topo = ndp.Topology.build(ndp.ParallelismConfig(dp_shard_size=world))
    config = model_config_for(
        base_model=None, model_shape="tiny", overrides={"tie_word_embeddings": True}, max_position_embeddings=64
    )
    model = meta_model(config)
    spec = ndp.LoraSpec(r=4, alpha=8, target_linear=True, seed=3)
    options = ndp.ParallelOptions(param_dtype="bfloat16", single_rank_fsdp=single_rank_fsdp)
    ndp.parallelize(model, topo, options=options, lora=spec)
    materialize(model, topo.device, weights_dir=None, seed=0)
    opt = ndp.build_optimizer(model, lr=1e-2)
    losses = []
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))  # the global batch
    for _ in range(3):
        batch = ndp.prepare_batch(ids, topo)
        count = ndp.count_tokens(batch.num_tokens, topo)
        loss = ndp.token_loss(model(**batch.model_inputs()).logits, batch.labels, num_tokens=count, topology=topo)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(ndp.reduce_loss(loss.detach(), topo)))
    return {
        "frozen": sorted({str(p.dtype) for p in model.parameters() if not p.requires_grad}),
        "trainable": sorted({str(p.dtype) for p in model.parameters() if p.requires_grad}),
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
        "losses": losses,
    }


def test_lora_keeps_its_frozen_base_in_bf16_on_every_path(parity_record):
    """Frozen weights are stored in the compute dtype (they are only read in it): the flat one-rank path, FSDP
    on one rank and FSDP on two train the same numbers, with bf16 frozen weights (a tied head still tied) and
    fp32 trainable ones."""
    flat = run_ranks(1, _train_lora_from_meta, False)[0]
    fsdp = run_ranks(1, _train_lora_from_meta, True)[0]
    sharded = run_ranks(2, _train_lora_from_meta, True)[0]
    for run in (flat, fsdp, sharded):
        assert (run["frozen"], run["trainable"], run["tied"]) == (["torch.bfloat16"], ["torch.float32"], True), run
    assert flat["losses"] == fsdp["losses"]
    diff = max_rel_diff(sharded["losses"], flat["losses"])
    parity_record({"loss": diff})
    assert diff < 2e-3, (sharded["losses"], flat["losses"])  # bf16: two ranks sum their gradients in another order
    assert flat["losses"][-1] < flat["losses"][0]


def _trained_then_dropped(param_dtype, master_grads: bool) -> dict:
    import gc
    import weakref

    import torch

    import ndparallel as ndp
    from ndparallel.train.loop import forward_backward
    from ndparallel.weights.materialize import materialize
    from ndparallel.weights.meta import meta_model, model_config_for

    topo = ndp.Topology.build(ndp.ParallelismConfig(dp_shard_size=1))

    def train_one_step():
        config = model_config_for(base_model=None, model_shape="tiny", overrides={}, max_position_embeddings=64)
        model = meta_model(config)
        ndp.parallelize(model, topo, options=ndp.ParallelOptions(param_dtype=param_dtype))
        materialize(model, topo.device, weights_dir=None, seed=0)
        opt = ndp.build_optimizer(model, lr=1e-3, master_grads=master_grads)
        batches = [ndp.prepare_batch(torch.randint(0, 256, (2, 64)), topo) for _ in range(2)]
        forward_backward(model, batches, topo)
        ndp.clip_grad_norm_(list(model.parameters()), 1.0, optimizer=opt)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return [weakref.ref(p) for p in model.parameters()]

    refs = train_one_step()
    gc.collect()
    return {"parameters": len(refs), "alive": sum(ref() is not None for ref in refs)}


@pytest.mark.parametrize("param_dtype, master_grads", [("bfloat16", False), ("bfloat16", True), (None, True)])
def test_a_dropped_model_is_freed(param_dtype, master_grads):
    """Nothing the flat path installs keeps a model alive once the caller drops it: the gradient hooks sit in
    the tensors' C++ hook tables, where a strong reference back to the tensor is a cycle Python's gc cannot
    see (it kept every model built in a process: on the H200, 0.2-0.3 GiB per LoRA 8B model of a sweep)."""
    got = run_ranks(1, _trained_then_dropped, param_dtype, master_grads)[0]
    assert got["parameters"] > 0 and got["alive"] == 0, got
