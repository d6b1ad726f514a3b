"""Tiny random-init models, synthetic global batches, and the same training run done two ways:
``train_reference`` in one plain process, ``train_parallel`` on every rank of a layout.

Both runs start from the same weights (same seed, built before any sharding) and see the same global
batches; parity tests compare their per-step losses, gradient norms and final weights.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

import ndparallel as ndp
from ndparallel import _compat
from ndparallel.weights.meta import attention_for
from support.family_configs import FAMILY_CONFIGS

VOCAB = 256
LR = 3e-3
WEIGHT_DECAY = 0.1
# AdamW divides by sqrt(v) + eps. For an element whose gradient is ~0, a small eps turns float32 rounding
# noise (different summation orders across layouts, ~1e-7 relative) into a visible update difference.
# eps=1e-5 bounds that amplification (update sensitivity <= lr/eps) so weight comparisons measure the
# parallelism, not the rounding. Measured on the same run (qwen3, fsdp2 x tp4): relative weight
# difference 3.0e-5 with eps 1e-6 (2.4e-5 with 1e-8 on another layout), 3.5e-6 with 1e-5.
EPS = 1e-5

_CONFIGS = {
    # 8 query and 8 key/value heads so tp can go up to 8.
    "llama": lambda **kw: LlamaConfig(**{**dict(num_key_value_heads=8), **kw}),
    # grouped-query attention: 8 query heads, 4 key/value heads (tp <= 4), q/k norms.
    "qwen3": lambda **kw: Qwen3Config(**{**dict(num_key_value_heads=4, head_dim=8), **kw}),
    # 8 query heads, 2 key/value heads (tp <= 2), sliding-window attention family.
    "mistral": lambda **kw: MistralConfig(**{**dict(num_key_value_heads=2, head_dim=8), **kw}),
    # attention biases on q/k/v.
    "qwen2": lambda **kw: Qwen2Config(**{**dict(num_key_value_heads=4), **kw}),
    **FAMILY_CONFIGS,
}


def model_config(family: str, *, tied: bool = False, **overrides):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
        attention_dropout=0.0,
    )
    return _CONFIGS[family](**{**base, **overrides})


def make_model(family: str, *, seed: int = 0, tied: bool = False, dtype=torch.float32, **overrides):
    torch.manual_seed(seed)
    cfg = model_config(family, tied=tied, **overrides)
    # eager where SDPA cannot express the model (Gemma 2's soft-capping), as transformers itself chooses.
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attention_for(cfg), dtype=dtype)
    return model.train()


def make_batches(
    *, steps: int, micro: int, rows: int, seq: int, seed: int = 1, pad: bool = False, packed: bool = False
) -> list[list[dict]]:
    """``steps`` x ``micro`` global micro-batches of ``rows`` x ``seq`` tokens.

    pad: rows end in right-padding of uneven lengths (so ranks hold uneven numbers of tokens);
    packed: rows hold several documents (position ids restart at 0).
    """
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(micro):
            ids = torch.randint(1, VOCAB, (rows, seq), generator=g)
            mb: dict = {"input_ids": ids}
            if pad:
                lengths = torch.randint(seq // 4, seq + 1, (rows,), generator=g)
                lengths[0] = seq // 4  # one short row, so padding is uneven across ranks
                mask = (torch.arange(seq)[None] < lengths[:, None]).long()
                mb["attention_mask"] = mask
            if packed:
                pos = torch.empty(rows, seq, dtype=torch.long)
                for r in range(rows):
                    cuts = sorted(torch.randint(1, seq, (3,), generator=g).tolist())
                    start = 0
                    for end in [*cuts, seq]:
                        pos[r, start:end] = torch.arange(end - start)
                        start = end
                mb["position_ids"] = pos
            step.append(mb)
        out.append(step)
    return out


def reference_mask(mb: dict, window: int | None = None) -> dict:
    """The single-process model inputs that express a micro-batch's padding / packing.

    Packed rows get an explicit (B, 1, S, S) mask: causal, inside a document, off padding keys, and within
    the sliding ``window`` if the model has one. Padded rows get transformers' own 2-D mask handling.
    """
    inputs = {"input_ids": mb["input_ids"]}
    if "position_ids" in mb:
        pos = mb["position_ids"]
        doc = torch.cumsum(pos == 0, dim=-1)
        seq = pos.shape[1]
        i = torch.arange(seq, device=pos.device)
        allowed = (i[:, None] >= i[None, :]) & (doc[:, :, None] == doc[:, None, :])
        if window is not None:
            allowed &= (i[:, None] - i[None, :]) < window
        if "attention_mask" in mb:
            real = mb["attention_mask"].bool()
            allowed &= real[:, None, :] | ~real[:, :, None]  # real queries never see padding keys
        inputs["attention_mask"] = allowed.unsqueeze(1)
        inputs["position_ids"] = pos
    elif "attention_mask" in mb:
        inputs["attention_mask"] = mb["attention_mask"]
        inputs["position_ids"] = (mb["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    return inputs


def plain_targets(
    labels: torch.Tensor, attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Each token's target is the next token's label (-100: none): none at a row's end, before a packed
    document's start (the next position id is 0) or at padding. Plain torch, not ndparallel's."""
    if attention_mask is not None:
        labels = labels.masked_fill(attention_mask == 0, -100)
    targets = torch.full_like(labels, -100)
    targets[:, :-1] = labels[:, 1:]
    if position_ids is not None:
        targets[:, :-1] = targets[:, :-1].masked_fill(position_ids[:, 1:] == 0, -100)
    return targets


def _labels(mb: dict) -> torch.Tensor:
    return plain_targets(mb["input_ids"], mb.get("attention_mask"), mb.get("position_ids"))


def peft_lora(model, spec):
    """peft's LoRA with ``spec``'s settings (an ndparallel ``LoraSpec``, read as plain values); the adapters
    start from ndparallel's seeded values (A; B = 0), so both start at the same point."""
    from peft import LoraConfig, get_peft_model

    from ndparallel.adapters.lora import init_lora_tensor

    peft_model = get_peft_model(
        model,
        LoraConfig(
            r=spec.r,
            lora_alpha=spec.alpha,
            lora_dropout=spec.dropout,
            target_modules=spec.target_modules or "all-linear",
            modules_to_save=spec.modules_to_save or None,
        ),
    )
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_" in name:
                param.copy_(init_lora_tensor(_from_peft_name(name), tuple(param.shape), spec.seed, param.device))
    return peft_model


def _from_peft_name(name: str) -> str | None:
    """peft's state-dict name as ndparallel's (transformers' + .lora_A/.lora_B); None for peft's frozen copy."""
    if ".original_module." in name:
        return None
    name = name.removeprefix("base_model.model.").replace(".modules_to_save.default.", ".")
    return name.replace(".base_layer.", ".").replace(".default.", ".")


def train_reference_peft(model, batches, lora, *, max_norm: float = 1.0) -> dict:
    """``train_reference`` with the adapters made by peft instead of ndparallel's attach_lora."""
    result = train_reference(peft_lora(model, lora), batches, max_norm=max_norm)
    result["weights"] = {_from_peft_name(k): v for k, v in result["weights"].items() if _from_peft_name(k)}
    return result


def _dense_micro_loss(
    model, mb: dict, labels: torch.Tensor, num_tokens: int, num_micro: int, *, transformers_masks: bool = False
) -> torch.Tensor:
    if transformers_masks:  # use_cache=False: transformers looks for packed documents only without a KV cache
        inputs = {"use_cache": False, **{k: mb[k] for k in ("input_ids", "position_ids") if k in mb}}
    else:
        inputs = reference_mask(mb, getattr(model.config, "sliding_window", None))
    logits = model(**inputs).logits
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / num_tokens


def train_reference(
    model,
    batches,
    *,
    max_norm: float = 1.0,
    lora=None,
    micro_loss=None,
    transformers_masks: bool = False,
    eps: float = EPS,
) -> dict:
    """Plain PyTorch, one process: the numbers every layout must reproduce. ``lora``: adapters added by
    ndparallel's attach_lora (``train_reference_peft`` adds them with peft).

    ``micro_loss(model, micro_batch, labels, num_tokens, num_micro_batches)``: one micro-batch's loss.
    transformers_masks: give packed rows to the model as transformers takes them (input ids and position ids
    restarting at 0, no mask, no KV cache), so transformers builds each layer's document mask itself
    (sliding or full).
    """
    micro_loss = micro_loss or functools.partial(_dense_micro_loss, transformers_masks=transformers_masks)
    if lora is not None:
        from ndparallel.adapters.lora import attach_lora

        attach_lora(model, lora, tp_mesh=None)
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.dim() >= 2]
    no_decay = [p for p in trainable if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR,
        betas=(0.9, 0.95),
        eps=eps,
    )
    losses, norms = [], []
    for step in batches:
        labels = [_labels(mb) for mb in step]
        n = sum(int((lab != -100).sum()) for lab in labels)
        total = 0.0
        for mb, lab in zip(step, labels):
            loss = micro_loss(model, mb, lab, n, len(step))
            loss.backward()
            total += loss.item()
        norms.append(_clip_in_float64(trainable, max_norm))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {
        "losses": losses,
        "grad_norms": norms,
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def _clip_in_float64(params, max_norm: float) -> float:
    """torch's clip_grad_norm_ rule (scale by max_norm / (norm + 1e-6) when above), with the norm summed in
    float64: torch sums squares in float32, which over a few 100k-element gradient is off by ~1e-5 relative
    (measured 1.45e-5 on GLM with a 4,099-token vocabulary), the parity tolerance itself."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = float(torch.stack([g.double().pow(2).sum() for g in grads]).sum().sqrt())
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return norm


def train_parallel(
    family: str,
    layout: dict,
    batches,
    *,
    model_kwargs: dict | None = None,
    options: dict | None = None,
    max_norm: float = 1.0,
    lora=None,
    gradient_sync: str = "every_micro_batch",
    build=None,
    eps: float = EPS,
    master_grads: bool = True,
) -> dict:
    """The same run through ndparallel on this rank's part of ``layout``. Rank 0 returns the full weights.

    ``master_grads=False``: ``build_optimizer``'s one-rank mode that reads bf16 gradients in place (the
    trainer's); clipping then goes through the optimizer, which knows where the gradients are.

    ``gradient_sync``: when FSDP reduces the gradients of accumulated micro-batches (``set_gradient_sync``).
    ``build``: the model factory (default ``make_model``); the router loss of MoE models is added (zero otherwise).
    """
    topo = ndp.Topology.build(ndp.ParallelismConfig(**layout))
    model = (build or make_model)(family, **(model_kwargs or {}))
    ndp.parallelize(model, topo, options=ndp.ParallelOptions(**{"param_dtype": None, **(options or {})}), lora=lora)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = ndp.build_optimizer(model, lr=LR, weight_decay=WEIGHT_DECAY, eps=eps, master_grads=master_grads)
    losses, norms = [], []
    for step in batches:
        prepared = [ndp.prepare_batch(topology=topo, **mb) for mb in step]
        n = ndp.count_tokens(sum(b.num_tokens for b in prepared), topo)
        total = 0.0
        for i, batch in enumerate(prepared):
            ndp.set_gradient_sync(model, i == len(prepared) - 1, mode=gradient_sync)
            # the fused lm_head + loss (parallelize's default LossHead) unless options turn it off
            loss, out = ndp.model_loss(model, batch.model_inputs(), batch.labels, num_tokens=n, topology=topo)
            loss = loss + ndp.router_aux_loss(
                out, batch, config=model.config, topology=topo, num_micro_batches=len(prepared)
            )
            loss.backward()
            total += loss.detach()
        norms.append(float(ndp.clip_grad_norm_(trainable, max_norm, optimizer=None if master_grads else opt)))
        opt.step()
        opt.zero_grad()
        losses.append(float(ndp.reduce_loss(total, topo)))
    weights = {}
    for name, value in model.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        weights[_compat.canonical_name(name)] = full.detach().cpu()
    result = {"losses": losses, "grad_norms": norms, "weights": weights if topo.rank == 0 else None}
    if lora is not None:  # the adapters in PEFT's names and layout (a collective)
        from ndparallel.adapters.lora import adapter_state

        result["adapters"] = adapter_state(model, lora) if topo.rank == 0 else (adapter_state(model, lora) and None)
    return result


def assert_parity(ref: dict, got: dict, tol: float = 1e-5) -> dict:
    """Per-step loss and grad norm (relative), final weights (relative Frobenius per tensor) within tol."""
    loss_diff = max_rel_diff(got["losses"], ref["losses"])
    norm_diff = max_rel_diff(got["grad_norms"], ref["grad_norms"])
    weight_diff, where = 0.0, ""
    for name, r in ref["weights"].items():
        g = got["weights"][name].to(r.dtype)
        d = float((g - r).norm() / r.norm().clamp(min=1e-12))
        if d > weight_diff:
            weight_diff, where = d, name
    assert loss_diff <= tol, f"loss differs by {loss_diff:.2e}: {got['losses']} vs {ref['losses']}"
    assert norm_diff <= tol, f"grad norm differs by {norm_diff:.2e}: {got['grad_norms']} vs {ref['grad_norms']}"
    assert weight_diff <= tol, f"weights differ by {weight_diff:.2e} in {where}"
    return {"loss": loss_diff, "grad_norm": norm_diff, "weights": weight_diff}


def world_size(layout: dict) -> int:
    n = 1
    for name, size in layout.items():
        if isinstance(size, int) and name != "expert_parallel_size":  # ep borrows ranks, it adds none
            n *= size
    return n


def max_rel_diff(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float(((a - b).abs() / b.abs().clamp(min=1e-12)).max())


def max_weight_diff(ref: dict, got: dict) -> tuple[float, str]:
    """Largest |a-b| / max(|b|) over tensors, and the tensor it is in."""
    worst, where = 0.0, ""
    for name, r in ref.items():
        g = got[name]
        d = float((g.double() - r.double()).abs().max() / r.double().abs().max().clamp(min=1e-12))
        if d > worst:
            worst, where = d, name
    return worst, where
