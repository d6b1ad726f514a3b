"""What ``bench_finetune.py`` and its row processes (``finetune_rows.py``) share: the rows, the shapes, the
one FLOPs formula, the loss bounds and the adapters' seeded start.

Nothing heavy at import (no transformers, no ndparallel): a peer's process must import its own library first
(Unsloth patches transformers when it is imported).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear of a decoder block: what ``lora_target_linear: true`` adapts in ours."""

LEARNING_RATE = 2e-4
CLIP_NORM = 1.0
NF4_GROUP = 64 * 256
"""ours (``quantized/nf4.py``) keeps a weight in NF4 only when it holds whole groups of 64 x 256 values; the
torchao peer follows the same rule, so both quantize the same weights (every linear of an 8B)."""


@dataclass(frozen=True)
class RowKind:
    """A family of rows measured against each other: the same base-weight format and what trains."""

    name: str
    ours: tuple[str, ...]
    """Our rows of the kind; the first one present is the loss reference of the kind."""
    peers: tuple[str, ...]
    loss_bound: float
    """|loss - ours' loss| allowed at the last step (same initial weights, adapters, data and optimizer)."""
    why: str
    also_against: str | None = None
    """Another kind whose rows ours are also set against, for information (an FP8 base against the bf16 base
    it replaces: what FP8 costs in loss and gains in speed and memory)."""


KINDS = (
    RowKind(
        "bf16",
        ("ours-lora",),
        ("unsloth-lora", "hf-peft-liger-compile", "hf-peft"),
        0.05,
        "LoRA r16 on a bf16 base: only kernels and bf16 rounding differ",
    ),
    RowKind(
        "nf4",
        ("ours-qlora",),
        ("unsloth-qlora", "peft-bnb4", "torchao-nf4-peft"),
        0.10,
        "QLoRA: NF4 blocks of 64 with double-quantized scales everywhere; bnb and torchao round the scales "
        "their own way",
    ),
    RowKind(
        "int8",
        ("ours-lora8",),
        ("peft-bnb8",),
        0.15,
        "LoRA on an 8-bit base: ours keeps int8 weights with one scale per row and multiplies in bf16; bnb's "
        "LLM.int8() also quantizes the activations (outliers above 6.0 in fp16)",
    ),
    RowKind(
        "fp8",
        ("ours-lora-fp8",),
        ("unsloth-lora-fp8",),
        0.10,
        "LoRA on an FP8 base: e4m3 weights with one scale per row, FP8 products on per-token scaled inputs and "
        "output gradients (ours: load_in_fp8; Unsloth: load_in_fp8=True, its rowwise FP8 forward); also set "
        "against the bf16 kind: what FP8 costs in loss",
        also_against="bf16",
    ),
    RowKind(
        "full",
        ("ours-full-adam8", "ours-full-adam8-masters", "ours-full-adam8-offload"),
        ("unsloth-full-adam8", "hf-full-adam8"),
        0.05,
        "full fine-tune with 8-bit AdamW (ours: torchao's on bf16 weights, bf16: full, stochastic rounding; "
        "-masters: on fp32 master weights; the peers: bitsandbytes', on the bf16 weights they load, as "
        "transformers' Trainer with optim adamw_bnb_8bit runs them)",
    ),
)

OURS_ROWS = {  # name -> ``--set`` settings of the trainer on top of the common ones (finetune_rows.ours_config)
    "ours-lora": {"adapter": "lora"},
    "ours-qlora": {"adapter": "qlora", "load_in_4bit": True},
    "ours-lora8": {"adapter": "lora", "load_in_8bit": True},
    "ours-lora-fp8": {"adapter": "lora", "load_in_fp8": True},
    "ours-full-adam8": {"adapter": None, "optimizer": "adamw_8bit", "bf16": "full"},
    "ours-full-adam8-masters": {"adapter": None, "optimizer": "adamw_8bit"},
    "ours-full-adam8-offload": {"adapter": None, "optimizer": "adamw_8bit", "bf16": "full", "cpu_offload": True},
}
PEER_ROWS = (
    "unsloth-lora",
    "unsloth-qlora",
    "unsloth-lora-fp8",
    "hf-peft-liger-compile",
    "hf-peft",
    "peft-bnb4",
    "peft-bnb8",
    "torchao-nf4-peft",
    "unsloth-full-adam8",
    "hf-full-adam8",
)
ALL_ROWS = (*OURS_ROWS, *PEER_ROWS)
DEFAULT_ROWS = tuple(name for name in ALL_ROWS if name != "hf-peft")

VERSIONED = (
    "torch",
    "transformers",
    "peft",
    "accelerate",
    "unsloth",
    "unsloth_zoo",
    "bitsandbytes",
    "liger-kernel",
    "torchao",
    "triton",
)


def kind_of(row: str) -> RowKind:
    return next(kind for kind in KINDS if row in kind.ours or row in kind.peers)


def versions() -> dict[str, str | None]:
    """Installed versions (package metadata only: nothing is imported)."""
    found = {}
    for name in VERSIONED:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def shape_config(shape: str):
    """The transformers config of ``--shape``: ``8b`` (ndparallel's preset, Llama-3.1-8B), ``qwen3-8b``
    (Qwen3-8B's dims, q/k norms), ``tiny`` / ``qwen3-tiny`` (CPU tests: every linear holds whole NF4 groups).
    ``max_position_embeddings`` covers the longest row, so no library rescales RoPE for long rows."""
    from transformers import LlamaConfig, Qwen3Config

    from ndparallel.models.presets import PRESETS

    tiny = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8)
    tiny.update(num_key_value_heads=8, head_dim=16, vocab_size=320, max_position_embeddings=4096)
    qwen3_8b = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32)
    qwen3_8b.update(num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960)
    shapes = {
        "8b": lambda: LlamaConfig(**PRESETS["8b"], max_position_embeddings=131072),
        "qwen3-8b": lambda: Qwen3Config(**qwen3_8b, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False),
        "tiny": lambda: LlamaConfig(**tiny, tie_word_embeddings=False),
        "qwen3-tiny": lambda: Qwen3Config(**tiny, tie_word_embeddings=False),
    }
    if shape not in shapes:
        raise SystemExit(f"--shape {shape!r}: use one of {', '.join(shapes)}")
    return shapes[shape]()


def lora_params(config, rank: int) -> int:
    """Adapter weights of rank ``rank`` on the 7 linears of every decoder block: r x (in + out) each."""
    h, inter = config.hidden_size, config.intermediate_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    q, k = heads * head_dim, kv * head_dim
    per_layer = (h + q) + 2 * (h + k) + (q + h) + 2 * (h + inter) + (inter + h)
    return config.num_hidden_layers * rank * per_layer


def step_flops(config, *, kind: str, rows: int, seq: int, lora_rank: int) -> float:
    """Model FLOPs of one optimizer step over ``rows`` rows of ``seq`` tokens (each row one document), the one
    formula every row's MFU uses, the trainer's (``ndparallel.step.flops.flops_per_token``). T = rows x seq
    tokens; N = the matmul weights a token passes through (the decoder's linears and the output head).

    - full fine-tune: 6 N T (forward 2, input gradients 2, weight gradients 2) + attention;
    - LoRA / QLoRA / int8 base (frozen): forward 2 N T + input gradients 2 N T (a frozen weight gets no weight
      gradient GEMM) + the adapters' 6 N_lora T (N_lora = r x (in + out) per adapted linear) + attention;
    - attention: per (query, key) pair a causal row attends, 4 x heads x head_dim forward and twice that
      backward (``AttentionFlops.of_row``).

    Recomputation (activation checkpointing) is not counted: model FLOPs, not hardware FLOPs. Nor is the
    dequantization of a 4/8-bit base. (Layer 0 needs no input gradient either; the convention counts it.)"""
    from ndparallel.step.flops import AttentionFlops, flops_per_token

    frozen = kind != "full"
    adapters = lora_params(config, lora_rank) if frozen else 0
    per_token = flops_per_token(config, frozen_base=frozen, adapter_params=adapters)
    return rows * seq * per_token + rows * AttentionFlops(config).of_row(seq)


def ours_adapter_key(peft_name: str) -> str | None:
    """peft's name of an adapter weight -> ours' (``base_model.model.X.lora_A.default.weight`` ->
    ``X.lora_A.weight``); None for any other parameter."""
    if ".lora_A." not in peft_name and ".lora_B." not in peft_name:
        return None
    name = peft_name.removeprefix("base_model.model.")
    return name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")


def seed_adapters_like_ours(model, seed: int) -> int:
    """Give a peft model's adapters ours' start (``init_lora_tensor``: A uniform(+-1/sqrt(in)) drawn from
    (seed, name) on the adapter's device, B zeros), so every LoRA row starts from the same adapters, not only
    the same base. Returns how many adapter weights were set."""
    import torch

    from ndparallel.adapters.lora import init_lora_tensor

    count = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            key = ours_adapter_key(name)
            if key is None:
                continue
            param.copy_(init_lora_tensor(key, tuple(param.shape), seed, param.device))
            count += 1
    return count


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
