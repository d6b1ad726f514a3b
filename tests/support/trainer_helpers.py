"""Small configs and in-process runs of ``ndparallel train`` for tests (ranks forked by ``run_ranks``)."""

from __future__ import annotations

import functools
import itertools
import json
import random
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from ndparallel.testing.ranks import run_ranks
from support.scenarios import max_rel_diff

WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
    "upsilon phi chi psi omega parallel shard tensor context ring gather token loss"
).split()


def write_corpus(directory: Path, *, docs: int = 60, seed: int = 0) -> Path:
    """A JSONL completion dataset of short pseudo-sentences (learnable: a small fixed vocabulary)."""
    rng = random.Random(seed)
    path = directory / "corpus.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(docs):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40))) + "."
            f.write(json.dumps({"text": text}) + "\n")
    return path


SMALL_LORA = {"lora_r": 4, "lora_alpha": 8, "lora_target_linear": True, "learning_rate": 1e-2}
"""Rank-4 adapters on every linear, a learning rate that moves them within a few steps."""


def tiny_config(tmp: Path, **overrides) -> dict:
    """A fp32 CPU config of a tiny Llama with the byte tokenizer; global batch 8 rows of 64 tokens."""
    corpus = tmp / "corpus.jsonl"
    if not corpus.exists():
        write_corpus(tmp)
    config = {
        "model_shape": "tiny",
        "model_config_overrides": {"vocab_size": 320},
        "tokenizer_config": "byte",
        "datasets": [{"path": str(corpus), "type": "completion"}],
        "dataset_prepared_path": str(tmp / "prepared"),
        "sequence_len": 64,
        "sample_packing": True,
        "long_rows": "split",  # documents longer than a row are cut into pieces (Axolotl's default drops them)
        "micro_batch_size": 8,
        "max_steps": 6,
        "learning_rate": 3e-3,
        "warmup_steps": 2,
        "weight_decay": 0.1,
        "adam_epsilon": 1e-5,
        "output_dir": str(tmp / "out"),
        "logging_steps": 1,
        "seed": 1,
        "use_tensorboard": False,  # ~1 s of import per run; tests/multirank/test_tracking.py turns it on
    }
    config.update(overrides)
    return config


def _train(config: dict, probe: bool):
    from ndparallel.config.reading import parse_config
    from ndparallel.train.loop import run_training

    result = run_training(parse_config(config))
    return {"records": result.records, "steps": result.steps}


def run_train(world: int, config: dict, **kwargs) -> list[dict]:
    """Train on ``world`` forked ranks; rank 0's metrics records."""
    return run_ranks(world, _train, config, False, **kwargs)[0]["records"]


def _cli(args: list[str]) -> tuple[int, str]:
    import contextlib
    import io

    from ndparallel.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(args)
    return code, err.getvalue()


def cli_train(tmp: Path, config: dict) -> tuple[int, str]:
    """``ndparallel train`` of ``config`` as the worker of a one-rank job (forked); (exit code, stderr)."""
    import time

    import yaml

    path = tmp / f"config-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump(config))
    return run_ranks(1, _cli, ["train", str(path)])[0]


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("ndparallel: error:")]


def train_one_and_many(tmp: Path, model, *, layout: dict, **settings) -> tuple[dict, dict, list[dict], list[dict]]:
    """``model`` saved as the base model of a tiny config with ``settings`` (4 steps, a checkpoint at step 2),
    trained on one rank and on ``layout`` (``layout_config``'s keys). Returns (config, the layout's config,
    one rank's records, the layout's records)."""
    model.save_pretrained(tmp / "base")
    config = tiny_config(
        tmp, base_model=str(tmp / "base"), model_shape=None, model_config_overrides={}, max_steps=4, save_steps=2
    )
    config.update(settings)
    single = run_train(1, {**config, "output_dir": str(tmp / "single")})
    parallel_config = {**layout_config(config, **layout), "output_dir": str(tmp / "par")}
    world = layout.get("r", 1) * layout.get("s", 1) * layout.get("c", 1) * layout.get("t", 1)
    return config, parallel_config, single, run_train(world, parallel_config)


def resume_on(layout: dict, config: dict, checkpoint: Path, output_dir: Path) -> list[dict]:
    """Resume ``checkpoint`` on ``layout`` (``layout_config``'s r/s/c/t keys); rank 0's records."""
    world = layout.get("r", 1) * layout.get("s", 1) * layout.get("c", 1) * layout.get("t", 1)
    resumed = {
        **layout_config(config, **layout),
        "output_dir": str(output_dir),
        "resume_from_checkpoint": str(checkpoint),
    }
    return run_train(world, resumed)


def resume_at_step_2(tmp: Path, config: dict, layout: dict) -> list[dict]:
    """Resume the step-2 checkpoint of ``train_one_and_many``'s layout run (under ``tmp``) on ``layout``, in an
    output directory of its own; rank 0's records."""
    out = tmp / f"resumed-{'-'.join(f'{k}{v}' for k, v in sorted(layout.items()))}"
    return resume_on(layout, config, tmp / "par" / "checkpoints" / "step-2", out)


def layout_config(config: dict, *, r=1, s=1, c=1, t=1, method="allgather") -> dict:
    """``config`` on layout (r, s, c, t), with micro_batch_size keeping the same global batch."""
    global_rows = config["micro_batch_size"] * config.get("dp_replicate_size", 1) * _shard(config)
    return {
        **config,
        "dp_replicate_size": r,
        "dp_shard_size": s,
        "context_parallel_size": c,
        "tensor_parallel_size": t,
        "cp_comm_strategy": method,
        "micro_batch_size": global_rows // (r * s),
    }


def _shard(config: dict) -> int:
    s = config.get("dp_shard_size", -1)
    return 1 if s in (-1, "auto") else s


def full_state(model, optimizer=None) -> dict:
    """Gathered model (and optimizer) tensors by name, on CPU (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    out = {f"model.{k}": _full(v) for k, v in get_model_state_dict(model, options=options).items()}
    if optimizer is not None:
        osd = get_optimizer_state_dict(model, optimizer, options=options)
        for name, state in osd["state"].items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    out[f"optim.{name}.{key}"] = _full(value)
    return out


def _full(value):
    value = value.full_tensor() if isinstance(value, DTensor) else value
    return value.detach().cpu().clone()


def round_trip_nf4(model) -> int:
    """QLoRA's base weights the plain way: each decoder-block linear weight made of whole NF4 scale groups
    (64 x 256 values) replaced by its 4-bit value (torchao's to_nf4, dequantized). Returns how many."""
    from torchao.quantization import to_nf4

    count = 0
    with torch.no_grad():
        for name, module in model.model.layers.named_modules():
            if isinstance(module, torch.nn.Linear) and module.weight.numel() % (64 * 256) == 0:
                module.weight.copy_(to_nf4(module.weight.detach().contiguous(), 64, 256).to(torch.float32))
                count += 1
    return count


def round_trip_int8(model) -> int:
    """8-bit base weights the plain way: each decoder-block linear weight replaced by its row-wise absmax
    int8 value (scale = max |row| / 127, codes rounded to [-127, 127]; fp32). Returns how many."""
    count = 0
    with torch.no_grad():
        for module in model.model.layers.modules():
            if isinstance(module, torch.nn.Linear):
                weight = module.weight
                scale = weight.abs().amax(dim=1, keepdim=True) / 127
                weight.copy_(torch.round(weight / scale).clamp(-127, 127) * scale)
                count += 1
    return count


def _e4m3_rows(t: torch.Tensor) -> torch.Tensor:
    """Each row of ``t`` (fp32) at its e4m3 value with the row's absmax scale (max |row| / 448)."""
    scale = (t.abs().amax(dim=-1, keepdim=True) * (1 / 448.0)).clamp(min=torch.finfo(torch.float32).tiny)
    return (t / scale).to(torch.float8_e4m3fn).to(t.dtype) * scale


class _PlainFp8Linear(torch.autograd.Function):
    """y = e4m3(x) @ W^T + b; the input gradient (e4m3 per token of grad * s) @ C, where W = s * C row by row."""

    @staticmethod
    def forward(ctx, x, codes, row_scale, bias):
        ctx.save_for_backward(codes, row_scale)
        y = _e4m3_rows(x) @ (codes * row_scale[:, None]).t()
        return y + bias if bias is not None else y

    @staticmethod
    def backward(ctx, grad):
        codes, row_scale = ctx.saved_tensors
        return _e4m3_rows(grad * row_scale) @ codes, None, None, None


def round_trip_fp8(model) -> int:
    """FP8 base weights and products the plain way: each decoder-block linear weight replaced by its row-wise
    absmax e4m3 value (fp32: row scale s = max |row| / 448, values C = e4m3(W / s)), and its forward by
    ``_PlainFp8Linear``: the input at its per-token e4m3 value, the input gradient from the output gradient times
    s at its per-token e4m3 value, multiplied by C (sums in fp32, as FP8 products sum). Returns how many."""
    count = 0
    with torch.no_grad():
        for module in model.model.layers.modules():
            if isinstance(module, torch.nn.Linear):
                row_scale = (module.weight.abs().amax(dim=1) / 448.0).clamp(min=torch.finfo(torch.float32).tiny)
                codes = (module.weight / row_scale[:, None]).to(torch.float8_e4m3fn).float()
                module.weight.copy_(codes * row_scale[:, None])
                module.forward = functools.partial(_plain_fp8_forward, module, codes, row_scale)
                count += 1
    return count


def _plain_fp8_forward(module, codes, row_scale, x):
    return _PlainFp8Linear.apply(x, codes, row_scale, module.bias)


def plain_qat(model, qat: dict) -> None:
    """torchao's QAT prepare step on the whole model, as Axolotl applies it (every linear layer, the head
    included): int8 per-token inputs (if asked) and int4 grouped weights, or MX FP4."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig
    from torchao.quantization.qat.fake_quantize_config import Int4WeightFakeQuantizeConfig

    if qat["weight_dtype"] == "mxfp4":
        from torchao.prototype.qat import MXFakeQuantizeConfig

        act = weight = MXFakeQuantizeConfig(dtype=torch.float4_e2m1fn_x2, block_size=32)
    else:
        weight = Int4WeightFakeQuantizeConfig(group_size=qat.get("group_size", 32), activation_dtype=torch.bfloat16)
        act = (
            IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False) if qat.get("activation_dtype") else None
        )
    quantize_(model, QATConfig(activation_config=act, weight_config=weight, step="prepare"))


def assert_runs_match(runs: list[list[dict]], ref: dict, parity_record, *, tol: float = 1e-5) -> None:
    """Each run's per-step losses and gradient norms within ``tol`` (relative) of the reference's."""
    for records in runs:
        loss_diff = max_rel_diff(losses(records), ref["losses"])
        norm_diff = max_rel_diff([r["grad_norm"] for r in records], ref["grad_norms"])
        parity_record({"loss": loss_diff, "grad_norm": norm_diff})
        assert loss_diff < tol and norm_diff < tol, (losses(records), ref["losses"])


def losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records]


def plain_reference(config: dict, trainable: set[str] | None = None) -> dict:
    """``ndparallel train``'s run at world 1 redone with plain transformers + torch (+ peft for LoRA): the
    model from ``base_model``, the token-weighted loss over shifted labels with a block-diagonal causal mask
    for packed documents, AdamW (no decay on 1-D tensors), warm-up then cosine, clipping. Only the data (the
    packed rows and their order) comes from ndparallel's data pipeline, which tests/unit/test_data_* check.
    LoRA adapters start from ndparallel's seeded init (B = 0, so the model starts as the base model).
    ``trainable``: names of the only weights that train (the test's own list, for unfrozen_parameters).
    Returns per-step losses, gradient norms (before clipping) and the final weights."""
    import math

    from transformers import AutoModelForCausalLM

    from ndparallel.adapters.lora import LoraSpec
    from ndparallel.config.reading import parse_config
    from ndparallel.data.build import build_rows_distributed
    from ndparallel.data.load_tokenizer import load_tokenizer
    from ndparallel.data.sampler import DataOrder
    from ndparallel.train.run_inputs import dataset_specs
    from support.scenarios import peft_lora, plain_targets, reference_mask

    cfg = parse_config(config)
    tokenizer = load_tokenizer(cfg.tokenizer_config or cfg.base_model)
    rows, _ = build_rows_distributed(
        dataset_specs(cfg, template=tokenizer.chat_template),
        tokenizer,
        is_main=True,
        barrier=lambda: None,
        seq_len=cfg.sequence_len,
        packing=cfg.sample_packing,
        cache_dir=cfg.dataset_prepared_path,
        long_rows=cfg.long_rows_policy,
        seed=cfg.seed,
        deduplicate=cfg.dataset_exact_deduplication,
    )
    if cfg.curriculum_sampling:  # the rows in their order, epoch after epoch
        per_epoch = len(rows) // cfg.micro_batch_size
        rows_at = lambda b: list(range(b * cfg.micro_batch_size, (b + 1) * cfg.micro_batch_size))  # noqa: E731
        batches = (rows_at(b) for _ in itertools.count() for b in range(per_epoch))
    else:
        batches = iter(
            DataOrder(len(rows), rows_per_rank=cfg.micro_batch_size, batch_rank=0, batch_ranks=1, seed=cfg.seed)
        )
    model = AutoModelForCausalLM.from_pretrained(cfg.base_model, attn_implementation="sdpa", dtype=torch.float32)
    if cfg.load_in_4bit:
        round_trip_nf4(model)
    if cfg.load_in_8bit:
        round_trip_int8(model)
    if cfg.load_in_fp8:
        round_trip_fp8(model)  # before peft wraps the linears: the hooks stay on the base layers, not the adapters
    if cfg.qat is not None:
        plain_qat(model, cfg.qat.model_dump())
    if cfg.adapter in ("lora", "qlora"):
        model = peft_lora(model, LoraSpec.from_config(cfg))
    if trainable is not None:
        for name, param in model.named_parameters():
            param.requires_grad_(name in trainable)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in trainable if p.dim() >= 2], "weight_decay": cfg.weight_decay},
            {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=cfg.learning_rate,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_epsilon,
    )
    total = cfg.max_steps
    # warm-up steps as given, else Axolotl's default: 3% of the steps, at most 100
    warmup = int(cfg.warmup_steps) if cfg.warmup_steps is not None else min(int(0.03 * total), 100)

    def factor(step: int) -> float:  # warm-up, then cosine to 0
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    schedule = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    losses, norms = [], []
    for step in range(total):
        if cfg.qat is not None and cfg.qat.fake_quant_after_n_steps:  # fake quantization from step N + 1
            for module in model.modules():
                for quantizer in (
                    getattr(module, "activation_fake_quantizer", None),
                    getattr(module, "weight_fake_quantizer", None),
                ):
                    if quantizer is not None:
                        quantizer.enabled = step >= cfg.qat.fake_quant_after_n_steps
        micro = [rows.batch(next(batches)) for _ in range(cfg.gradient_accumulation_steps)]
        targets = [plain_targets(mb["labels"], mb["attention_mask"], mb["position_ids"]) for mb in micro]
        count = sum(int((t != -100).sum()) for t in targets)
        total_loss = 0.0
        for mb, target in zip(micro, targets):
            logits = model(**reference_mask(mb)).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum") / count
            loss.backward()
            total_loss += loss.item()
        # max_grad_norm unset means 1.0 (Axolotl's and transformers' default)
        max_norm = 1.0 if cfg.max_grad_norm is None else cfg.max_grad_norm
        norms.append(float(torch.nn.utils.clip_grad_norm_(trainable, max_norm)))
        opt.step()
        schedule.step()
        opt.zero_grad()
        losses.append(total_loss)
    state = {name: param.detach().clone() for name, param in model.named_parameters()}
    return {"losses": losses, "grad_norms": norms, "state": state}
