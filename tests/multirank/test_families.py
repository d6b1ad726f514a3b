"""Every dense decoder family trains like one plain transformers process, on every axis.

Per family: a tiny random-init config from transformers (``family_configs.py``: 2 layers, hidden 64, each
family feature switched on), fp32, 5 AdamW steps on packed rows (documents of random lengths, position
ids restarting at 0, boundaries inside CP chunks), compared with ``train_reference``: one plain process in
which transformers builds every layer's document mask itself (sliding or full) from the position ids.
Criteria as in ``test_parity.py``: per-step loss and gradient norm, and every final weight, within 1e-5.

The optimizer's eps is 1e-4 here (1e-5 elsewhere): these families start some tensors at zero (Gemma's
(1 + w) norm weights, GLM's biases), which move only ~lr per step, so their relative difference is made
of AdamW's amplification of float32 rounding where a gradient is ~eps (measured on Gemma 2, tp 2:
1.5e-5 with eps 1e-5, 2.4e-6 with 1e-4). A real fault moves whole tensors by far more.

Layouts: each family runs two layouts in one launch of 4 ranks, chosen to cover every axis without every
product (CI time: a 3-D layout on 8 CPU ranks costs ~3x the pair, most of it DTensor's first-step sharding
propagation on a 3-D mesh):
- (cp 2, tp 2): FSDP sharding over the cp ranks, context parallelism (the three methods rotate over the
  families) and tensor parallelism with sequence parallelism, vocabulary-parallel loss included;
- (dp_replicate 2, dp_shard 2): HSDP, replicas reading different rows and FSDP over the shard ranks.
Families that cannot take cp (Gemma 2's soft-capped attention, Falcon's own SDPA call) run
(dp_shard 2, tp 2) instead of the first; ``unit/test_families.py`` checks their one-line refusal. One
3-D layout on 8 ranks, (dp_replicate 2, cp 2, tp 2), runs Gemma 3 (per-layer sliding windows, q/k norms,
scaled tied embeddings); Llama, Qwen3 and Mistral have theirs in ``test_cp_parity.py``.
GLM and Cohere use an odd vocabulary of 4,099 tokens, which tp 2 splits 2,050 / 2,049 rows (untied, and
tied under logit_scale). A 49,155-token vocabulary trains the same way (loss within 1.8e-7, weights 4e-6
on cp 2 x tp 2), but the gradient norm of its 3.1M-element embedding, summed in float32 in another order,
is itself only good to ~1e-5 (4e-6 under plain FSDP 2 of the same model), too close to the tolerance.
"""

from __future__ import annotations

import functools

import pytest
import torch
from support.scenarios import assert_parity, make_batches, make_model, train_parallel, train_reference, world_size
from support.trainer_helpers import layout_config, run_train, tiny_config
from transformers import AutoModelForCausalLM

import ndparallel as ndp
from ndparallel.adapters.lora import LoraSpec
from ndparallel.cli import main
from ndparallel.testing.ranks import run_ranks

STEPS = 5
EPS = 1e-4


def L(r, s, c, t, method="allgather"):
    return dict(dp_replicate_size=r, dp_shard_size=s, cp_size=c, tp_size=t, cp_comm_strategy=method)


@functools.lru_cache(maxsize=None)
def _batches(vocab: int):
    batches = make_batches(steps=STEPS, micro=1, rows=4, seq=32, packed=True, seed=11)
    if vocab != 256:  # token ids over the whole vocabulary, the last id included (the last tp rank's slice)
        g = torch.Generator().manual_seed(12)
        for step in batches:
            for mb in step:
                mb["input_ids"] = torch.randint(1, vocab, mb["input_ids"].shape, generator=g)
                mb["input_ids"][0, :3] = vocab - 1
    return batches


@functools.lru_cache(maxsize=None)
def _reference(family: str, model_items: tuple):
    kwargs = dict(model_items)
    return train_reference(
        make_model(family, **kwargs), _batches(kwargs.get("vocab_size", 256)), transformers_masks=True, eps=EPS
    )


def _train_layouts(family, layouts, batches, model_kwargs, lora=None):
    """Several layouts of the same world size one after another in one launch (one fork, one process group)."""
    return [
        train_parallel(family, layout, batches, model_kwargs=model_kwargs, lora=lora, eps=EPS) for layout in layouts
    ]


HSDP = L(2, 2, 1, 1)
ODD_VOCAB = {"vocab_size": 4099}
CASES = [
    pytest.param("gemma2", [L(1, 2, 1, 2), HSDP], {}, id="gemma2"),
    pytest.param("gemma3", [L(1, 1, 2, 2, "ring"), HSDP], {}, id="gemma3"),
    pytest.param("phi3", [L(1, 1, 2, 2, "alltoall"), HSDP], {}, id="phi3"),
    pytest.param("granite", [L(1, 1, 2, 2, "allgather"), HSDP], {}, id="granite"),
    pytest.param("olmo2", [L(1, 1, 2, 2, "ring"), HSDP], {}, id="olmo2"),
    pytest.param("cohere", [L(1, 1, 2, 2, "alltoall"), HSDP], ODD_VOCAB, id="cohere-vocab4099-tied"),
    pytest.param("glm", [L(1, 1, 2, 2, "allgather"), HSDP], ODD_VOCAB, id="glm-vocab4099"),
    pytest.param("glm4", [L(1, 1, 2, 2, "ring"), HSDP], {}, id="glm4"),
    pytest.param("falcon", [L(1, 2, 1, 2), HSDP], {}, id="falcon"),
    pytest.param("qwen2", [L(1, 1, 2, 2, "alltoall")], {}, id="qwen2"),  # HSDP: test_parity.py
    pytest.param("gemma3", [L(2, 1, 2, 2, "allgather")], {}, id="gemma3-3d"),
]


@pytest.mark.parametrize("family, layouts, model_kwargs", CASES)
def test_family_matches_one_process(family, layouts, model_kwargs, parity_record):
    ref = _reference(family, tuple(sorted(model_kwargs.items())))
    batches = _batches(model_kwargs.get("vocab_size", 256))
    results = run_ranks(world_size(layouts[0]), _train_layouts, family, layouts, batches, model_kwargs)
    for layout, got in zip(layouts, results[0]):
        try:
            parity_record(assert_parity(ref, got))
        except AssertionError as exc:
            raise AssertionError(f"{family} on {layout}: {exc}") from None


def test_lora_on_fused_projections_under_tp(parity_record):
    """LoRA adapters on Phi-3's gathered qkv_proj / gate_up_proj and split-input o_proj / down_proj."""
    spec = LoraSpec(r=4, alpha=16, target_linear=True, seed=3)
    ref = train_reference(make_model("phi3"), _batches(256), lora=spec, transformers_masks=True, eps=EPS)
    got = run_ranks(2, _train_layouts, "phi3", [L(1, 1, 1, 2)], _batches(256), {}, spec)[0][0]
    parity_record(assert_parity(ref, got))


GEMMA2_TINY = {
    "model_type": "gemma2",
    "vocab_size": 4099,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 8,
    "sliding_window": 12,
    "query_pre_attn_scalar": 8,
    "attn_logit_softcapping": 2.0,
    "final_logit_softcapping": 1.5,
}


def _parallel_logits(config: dict, checkpoint: str, probe: torch.Tensor):
    from ndparallel.config.reading import parse_config
    from ndparallel.train.setup import setup

    run = setup(parse_config({**config, "resume_from_checkpoint": checkpoint}))
    batch = ndp.prepare_batch(probe, run.topo)
    with torch.no_grad():
        return ndp.gather_logits(run.model(**batch.model_inputs()).logits, run.topo), run.topo.batch_rank


def test_family_checkpoint_exports_to_transformers(tmp_path):
    """``ndparallel train`` on Gemma 2 (tied and scaled embeddings, soft caps, an odd vocabulary split over
    tp 2, FSDP 2) saves a checkpoint whose export transformers loads with the parallel model's logits."""
    config = layout_config(
        tiny_config(tmp_path, model_shape=None, model_config_overrides=GEMMA2_TINY, max_steps=2, save_steps=2), s=2, t=2
    )
    run_train(4, config)
    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "out"), str(out), "--dtype", "float32"]) == 0
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    probe = torch.randint(0, 4099, (4, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = exported(input_ids=probe).logits
    results = run_ranks(
        4,
        _parallel_logits,
        {**config, "output_dir": str(tmp_path / "o")},
        str(tmp_path / "out" / "checkpoints" / "step-2"),
        probe,
    )
    for logits, batch_rank in results:
        rows = slice(batch_rank * 2, batch_rank * 2 + 2)
        assert float((logits - want[rows]).abs().max() / want.abs().max()) < 1e-5
