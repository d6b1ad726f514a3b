"""LoRA on attention and on the experts of MoE models, against PEFT itself.

The reference is plain transformers + peft (``target_modules`` for attention, ``target_parameters`` for the
stacked expert weights), started from the same adapter values; after 5 steps the losses, gradient norms
and every adapter tensor in PEFT's own state dict (names and layout included) must agree. A saved adapter
directory loads with ``PeftModel.from_pretrained`` and gives ndparallel's logits.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from support.moe_scenarios import make_moe_model, train_parallel_moe, train_reference_moe
from support.scenarios import VOCAB, make_batches, max_rel_diff, world_size

from ndparallel.adapters.lora import LoraSpec, init_lora_tensor
from ndparallel.testing.ranks import run_ranks

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
SPEC = LoraSpec(r=2, alpha=4.0, target_modules=["q_proj", "v_proj"], target_parameters=EXPERTS, seed=5)


def _peft_model(family: str):
    """transformers + peft, adapters set to ndparallel's layout-independent initial values."""
    model = make_moe_model(family)
    wrapped = get_peft_model(
        model,
        LoraConfig(r=SPEC.r, lora_alpha=SPEC.alpha, target_modules=SPEC.target_modules, target_parameters=EXPERTS),
    )
    cpu = torch.device("cpu")
    with torch.no_grad():
        for name, module in model.named_modules():
            if not hasattr(module, "lora_A"):
                continue
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            if hasattr(module, "parameter_name"):  # an expert weight: A is (E*r, in), expert-major
                key = f"{name.replace('.base_layer', '')}.{module.parameter_name}_lora_A"
                a.copy_(init_lora_tensor(key, (module.num_experts, SPEC.r, a.shape[1]), SPEC.seed, cpu).flatten(0, 1))
            else:
                a.copy_(init_lora_tensor(f"{name}.lora_A.weight", tuple(a.shape), SPEC.seed, cpu))
            b.zero_()
    return wrapped


@pytest.mark.parametrize(
    "family, layout",
    [
        pytest.param(
            "qwen3_moe", dict(dp_shard_size=2, tp_size=2, expert_parallel_size=2), id="qwen3moe-fsdp2-tp2-ep2"
        ),
        pytest.param("gpt_oss", dict(dp_shard_size=2, expert_parallel_size=2), id="gptoss-ep2"),  # (E, in, out) weights
    ],
)
def test_expert_lora_matches_peft(family, layout, parity_record):
    batches = make_batches(steps=5, micro=1, rows=8, seq=32, packed=family != "gpt_oss", pad=family == "gpt_oss")
    reference = _peft_model(family)
    ref = train_reference_moe(reference.base_model.model, batches)
    got = run_ranks(world_size(layout), train_parallel_moe, family, layout, batches, lora=SPEC)[0]
    peft_state = get_peft_model_state_dict(reference)
    assert sorted(got["adapters"]) == sorted(peft_state)
    worst = max(float((got["adapters"][k] - v).norm() / v.norm().clamp(min=1e-12)) for k, v in peft_state.items())
    diffs = {
        "loss": max_rel_diff(got["losses"], ref["losses"]),
        "grad_norm": max_rel_diff(got["grad_norms"], ref["grad_norms"]),
        "weights": worst,
    }
    parity_record(diffs)
    assert max(diffs.values()) <= 1e-5, diffs


def _save_adapter(family: str, out_dir: str, probe: torch.Tensor):
    """One rank: ndparallel's model with non-zero adapters; saves them and returns its logits on ``probe``."""
    import ndparallel as ndp
    from ndparallel.adapters.lora import save_peft_adapter

    topo = ndp.Topology.build(ndp.ParallelismConfig(dp_shard_size=1))
    model = make_moe_model(family)
    ndp.parallelize(model, topo, options=ndp.ParallelOptions(param_dtype=None), lora=SPEC)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:  # one rank: the local part is the whole tensor (a DTensor under FSDP)
                local = param.to_local() if hasattr(param, "to_local") else param
                local.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    save_peft_adapter(model, SPEC, out_dir)
    return model(input_ids=probe).logits.detach()


def test_saved_expert_adapter_loads_in_peft(tmp_path):
    probe = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    ours = run_ranks(1, _save_adapter, "qwen3_moe", str(tmp_path), probe)[0]
    loaded = PeftModel.from_pretrained(make_moe_model("qwen3_moe"), str(tmp_path)).eval()
    theirs = loaded(input_ids=probe).logits.detach()
    assert float((ours - theirs).abs().max()) < 1e-5
    base = make_moe_model("qwen3_moe").eval()(input_ids=probe).logits.detach()
    assert float((ours - base).abs().max()) > 1e-3  # the adapters do change the output
