"""The peers of ``bench_finetune.py``, each built the way its users build it at its best, from the same local
checkpoint, with the same adapters (rank, alpha, the 7 linears of every block, dropout 0) started from ours'
seeded values (``finetune_common.seed_adapters_like_ours``). ``build_peer(row, spec, device)`` returns the
model ready to train (``finetune_rows.train_peer`` runs the loop) and a dict saying what was applied.

- ``unsloth-lora`` / ``unsloth-qlora`` / ``unsloth-lora-fp8``: ``FastLanguageModel.from_pretrained(dir,
  load_in_16bit / load_in_4bit / load_in_fp8=True)`` (FP8: it quantizes the checkpoint with torchao's rowwise
  config into a directory of its own and loads that),
  ``get_peft_model(..., use_gradient_checkpointing="unsloth")`` (its offloaded checkpointing) and
  ``for_training``. Its fused LoRA kernels engage with dropout 0 and no bias; its chunked fused
  cross-entropy engages when the forward gets ``labels`` and more than 1,024 tokens (``CausalLM_fast_forward``):
  the plain loop gives it both.
- ``hf-peft-liger-compile``: transformers bf16 + peft LoRA + Liger's kernels (RoPE, RMSNorm, SwiGLU, fused
  linear cross-entropy; patched into the model class before loading, its documented way) + gradient
  checkpointing (non-reentrant) + each decoder layer compiled in place. ``hf-peft``: the same without
  Liger and compile (the CPU test's peer).
- ``peft-bnb4`` / ``peft-bnb8``: transformers' ``BitsAndBytesConfig`` (NF4, double-quantized, bf16 compute /
  LLM.int8()) + peft + gradient checkpointing + Liger. Not ``prepare_model_for_kbit_training``: it casts the
  norms, embeddings and head to fp32 (slower, more memory); users after speed skip it. Eager: bnb's kernels
  are custom autograd functions that break torch.compile's graphs.
- ``torchao-nf4-peft``: transformers bf16, then each decoder linear holding whole NF4 groups gets a frozen
  torchao ``NF4Tensor`` weight (``to_nf4``, blocks of 64, scales in groups of 256: what ours and torchtune
  use); ``F.linear`` on it dispatches to torchao's ``linear_nf4`` (dequantize, bf16 GEMM, input gradient
  only), as torchtune's ``FrozenNF4Linear`` calls it. Then peft + gradient checkpointing + Liger + per-layer
  compile (torchtune compiles its NF4 layers).
- ``hf-full-adam8``: a full fine-tune as transformers' Trainer runs one with ``bf16: true`` and ``optim:
  adamw_bnb_8bit`` on a bf16 checkpoint: every weight trains in the bf16 it was loaded in (no fp32 master
  copy), bitsandbytes' ``AdamW8bit``, Liger's kernels, gradient checkpointing, each decoder layer compiled.
- ``unsloth-full-adam8``: ``FastLanguageModel.from_pretrained(dir, full_finetuning=True, load_in_16bit=True,
  use_gradient_checkpointing="unsloth")`` and bitsandbytes' ``AdamW8bit`` (its documented full fine-tune).

On a CPU (the tests) Liger (Triton) and compile do not apply and are left out; what was applied is recorded.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from finetune_common import LORA_TARGETS, NF4_GROUP, seed_adapters_like_ours

NEEDS = {  # row -> packages it imports (a missing one: the row prints "skipped")
    "unsloth-lora": ("unsloth",),
    "unsloth-qlora": ("unsloth", "bitsandbytes"),
    "unsloth-lora-fp8": ("unsloth", "torchao"),
    "hf-peft-liger-compile": ("peft", "liger_kernel"),
    "hf-peft": ("peft",),
    "peft-bnb4": ("peft", "bitsandbytes", "liger_kernel"),
    "peft-bnb8": ("peft", "bitsandbytes", "liger_kernel"),
    "torchao-nf4-peft": ("peft", "torchao", "liger_kernel"),
    "hf-full-adam8": ("bitsandbytes", "liger_kernel"),
    "unsloth-full-adam8": ("unsloth", "bitsandbytes"),
}
FULL_ROWS = {"hf-full-adam8", "unsloth-full-adam8"}  # every weight trains, with bitsandbytes' 8-bit AdamW
CUDA_ONLY = {"unsloth-lora", "unsloth-qlora", "unsloth-lora-fp8", "peft-bnb4", "peft-bnb8", *FULL_ROWS}
CUDA_ONLY_PACKAGES = {"liger_kernel"}  # Triton kernels: not applied on a CPU


def why_skipped(row: str, device: torch.device) -> str | None:
    """One line saying why ``row`` cannot run here, or None."""
    if device.type != "cuda" and row in CUDA_ONLY:
        return f"{row} needs a CUDA GPU"
    for package in NEEDS[row]:
        if device.type != "cuda" and package in CUDA_ONLY_PACKAGES:
            continue
        if importlib.util.find_spec(package) is None:
            return f"{package} is not installed"
    return None


def build_peer(row: str, spec: dict, device: torch.device) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The model of peer ``row``, adapters attached and seeded, in training mode; and what was applied."""
    cuda = device.type == "cuda"
    if row == "unsloth-full-adam8":
        return _unsloth(spec, device, base="bf16", full=True)
    if row.startswith("unsloth-"):
        return _unsloth(spec, device, base={"unsloth-qlora": "bnb4", "unsloth-lora-fp8": "fp8"}.get(row, "bf16"))
    if row == "hf-full-adam8":
        return _hf(spec, device, base="bf16", liger=cuda, compile_=cuda and spec["peer_compile"], adapters=False)
    if row == "hf-peft-liger-compile":
        return _hf(spec, device, base="bf16", liger=cuda, compile_=cuda and spec["peer_compile"])
    if row == "hf-peft":
        return _hf(spec, device, base="bf16", liger=False, compile_=False)
    if row in ("peft-bnb4", "peft-bnb8"):
        return _hf(spec, device, base=row[-4:], liger=cuda, compile_=False)
    if row == "torchao-nf4-peft":
        return _hf(spec, device, base="torchao-nf4", liger=cuda, compile_=cuda and spec["peer_compile"])
    raise ValueError(f"no peer row {row!r}")


def make_optimizer(row: str, params: list, *, lr: float, device: torch.device) -> torch.optim.Optimizer:
    """AdamW (betas and eps torch's defaults, no weight decay): bitsandbytes' 8-bit one for the full fine-tunes
    (``FULL_ROWS``), else torch's (fused on a GPU)."""
    if row in FULL_ROWS:
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=device.type == "cuda")


def compute_dtype(device: torch.device) -> torch.dtype:
    """bf16 on a GPU; fp32 on a CPU, where the test compares losses to 1e-4."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _hf(spec: dict, device: torch.device, *, base: str, liger: bool, compile_: bool, adapters: bool = True):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = spec["model_dir"]
    if liger:
        _apply_liger(AutoConfig.from_pretrained(model_dir).model_type)
    extra = {"quantization_config": _bnb_config(base)} if base in ("bnb4", "bnb8") else {}
    # torchao NF4: loaded on the CPU and quantized weight by weight on the device (``_torchao_nf4``).
    load_on = torch.device("cpu") if base == "torchao-nf4" else device
    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        dtype=compute_dtype(device),
        attn_implementation="sdpa",
        device_map={"": (load_on.index or 0) if load_on.type == "cuda" else "cpu"},
        **extra,
    )
    applied = {"base": base, "liger": liger, "compile": compile_, "gradient_checkpointing": spec["peer_ac"]}
    applied["adapters"] = adapters
    if base == "torchao-nf4":
        applied["nf4_weights"] = _torchao_nf4(model, device)
    if spec["peer_ac"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if adapters:
        model = _with_peft(model, spec)
    if compile_:
        # the same compile as ours: checkpointed layers stay compiled under transformers 5.25
        from ndparallel import _compat

        for layer in (model.get_base_model() if adapters else model).model.layers:
            _compat.compile_module(layer)
    model.train()
    return model, applied


def _with_peft(model, spec: dict):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=spec["lora_rank"],
        lora_alpha=spec["lora_alpha"],
        lora_dropout=0.0,
        target_modules=list(LORA_TARGETS),
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, config)
    seeded = seed_adapters_like_ours(model, spec["seed"])
    assert seeded == 2 * len(LORA_TARGETS) * model.config.num_hidden_layers, seeded
    return model


def _apply_liger(model_type: str) -> None:
    from liger_kernel import transformers as liger

    patch = {"llama": liger.apply_liger_kernel_to_llama, "qwen3": liger.apply_liger_kernel_to_qwen3}[model_type]
    patch(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True)


def _bnb_config(base: str):
    from transformers import BitsAndBytesConfig

    if base == "bnb8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )


def _torchao_nf4(model, device: torch.device) -> int:
    """Each decoder-block linear whose weight holds whole NF4 groups gets a frozen NF4Tensor weight, quantized
    on ``device`` one weight at a time from the model loaded on the CPU (the whole bf16 model is never on the
    GPU, as torchtune loads it); then the other weights and buffers move to ``device``. Returns how many
    weights are NF4."""
    from torchao.quantization import to_nf4

    count = 0
    with torch.no_grad():
        for layer in model.model.layers:
            for module in layer.modules():
                if isinstance(module, torch.nn.Linear) and module.weight.numel() % NF4_GROUP == 0:
                    nf4 = to_nf4(module.weight.to(device).contiguous(), 64, 256)
                    module.weight = torch.nn.Parameter(nf4, requires_grad=False)
                    count += 1
        moved: dict[int, torch.nn.Parameter] = {}  # by identity: a tied weight stays one parameter
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is not None and param.device != device:
                    if id(param) not in moved:
                        moved[id(param)] = torch.nn.Parameter(param.to(device), requires_grad=param.requires_grad)
                    module._parameters[name] = moved[id(param)]
            for name, buffer in list(module._buffers.items()):
                if buffer is not None:
                    module._buffers[name] = buffer.to(device)
    return count


def _unsloth(spec: dict, device: torch.device, *, base: str, full: bool = False):
    from unsloth import FastLanguageModel  # first: Unsloth patches transformers and peft when imported

    checkpointing = "unsloth" if spec["peer_ac"] else False
    model, _ = FastLanguageModel.from_pretrained(
        model_name=spec["model_dir"],
        max_seq_length=spec["seq"],
        dtype=torch.bfloat16,
        load_in_4bit=base == "bnb4",
        load_in_16bit=base == "bf16",  # its 16-bit LoRA / full fine-tune
        load_in_fp8=base == "fp8",  # its FP8 LoRA: torchao's rowwise FP8 weights, quantized on the fly
        full_finetuning=full,
        fix_tokenizer=False,  # the byte tokenizer needs no fixing; the rows come tokenized
        use_exact_model_name=True,  # a local directory, no hub name mapping
        use_gradient_checkpointing=checkpointing,  # what a full fine-tune uses; LoRA's is get_peft_model's
    )
    applied = {"base": base, "gradient_checkpointing": checkpointing, "full_finetuning": full}
    if not full:
        model = FastLanguageModel.get_peft_model(
            model,
            r=spec["lora_rank"],
            target_modules=list(LORA_TARGETS),
            lora_alpha=spec["lora_alpha"],
            lora_dropout=0.0,
            bias="none",
            use_gradient_checkpointing=checkpointing,
            random_state=spec["seed"],
        )
        seed_adapters_like_ours(model, spec["seed"])
    FastLanguageModel.for_training(model)
    applied["weights_dtype"] = str(next(p for p in model.parameters() if p.requires_grad).dtype)
    return model, applied
