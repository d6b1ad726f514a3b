"""LoRA adapters on any layout: frozen (sharded) base weights, trainable low-rank adapters placed to match
the split of the layer they adapt, saved and loaded in the PEFT format.

An adapted ``nn.Linear`` keeps its own weight and name (checkpoints and exports stay transformers' names)
and gains two children, ``lora_A`` (r x in) and ``lora_B`` (out x r), plus a forward hook that adds
``lora_B(lora_A(dropout(x))) * alpha / r`` to its output. Under tensor parallelism (t ranks):

    column-split base (q/k/v, gate/up): A replicated, B split on its output dim like the base
        x (B, S, in) replicated -> A -> (B, S, r) replicated -> B -> (B, S, out/t): matches the base's output
    row-split base (o, down): A split on its input dim like the base, B replicated
        x (B, S, in/t) -> A -> partial (B, S, r) -> reduce-scatter on the sequence -> (B, S/t, r)
        -> B -> (B, S/t, out): matches the base's sequence-parallel output

so nothing is gathered that the base layer does not gather already. FSDP then shards adapters and
frozen weights alike; only the adapters (and ``modules_to_save``) have gradients and optimizer state.

Why not ``peft`` itself: peft replaces each target with a wrapper module (``q_proj.base_layer``), which
moves the base weights away from the names our tensor-parallel plan and transformers' checkpoints use,
and its layers assume plain tensors. The adapter weights here load from and save to peft's format.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ndparallel import _compat
from ndparallel.adapters.lora_experts import (
    attach_expert_lora,
    expert_adapter_state,
    expert_target_parameters,
    merge_expert_lora,
)
from ndparallel.errors import ConfigError
from ndparallel.models.decoder import decoder_parts
from ndparallel.safe_io import bounded_regex

PEFT_PREFIX = "base_model.model."
MAX_LORA_R = 2**16
"""The largest adapter rank (a typo such as lora_r: 1000000 is one line at validate, not a MemoryError)."""


@dataclass
class LoraSpec:
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=list)
    target_linear: bool = False
    modules_to_save: list[str] = field(default_factory=list)
    target_parameters: list[str] = field(default_factory=list)
    """Stacked expert weights of MoE models to adapt (PEFT's target_parameters), e.g. mlp.experts.gate_up_proj."""
    seed: int = 0
    target_regex: str | None = None
    """A regular expression the full module path must match (PEFT's meaning of a string target_modules)."""
    """Seeds the adapters' initial values (per parameter name: the same on every layout)."""

    @property
    def scaling(self) -> float:
        return self.alpha / self.r

    @classmethod
    def from_config(cls, cfg) -> "LoraSpec | None":
        if cfg.adapter not in ("lora", "qlora"):
            return None
        targets = cfg.lora_target_modules
        return cls(
            r=cfg.lora_r,
            alpha=cfg.lora_alpha,
            dropout=cfg.lora_dropout,
            target_modules=list(targets) if isinstance(targets, list) else [],
            target_regex=targets if isinstance(targets, str) else None,
            target_linear=cfg.lora_target_linear,
            modules_to_save=list(cfg.lora_modules_to_save or []),
            target_parameters=list(cfg.lora_target_parameters or []),
            seed=cfg.seed,
        )

    @classmethod
    def from_checkpoint(cls, path: Path) -> "LoraSpec | None":
        """The adapters a checkpoint's ``extra.json`` describes (checked: it is data from disk); ValueError or
        TypeError when its settings are not what ndparallel writes."""
        extra = Path(path) / "extra.json"
        if not extra.is_file():
            return None
        data = json.loads(extra.read_text(encoding="utf-8")).get("lora")
        if not data:
            return None
        spec = cls(**data)
        spec.check()
        return spec

    def check(self) -> None:
        """ValueError unless every field has the type and range ndparallel writes (r at most MAX_LORA_R)."""

        def whole(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        def number(value) -> bool:
            return (whole(value) or isinstance(value, float)) and math.isfinite(value)

        def names(value) -> bool:
            return isinstance(value, list) and all(isinstance(v, str) for v in value)

        checks = [
            (whole(self.r) and 1 <= self.r <= MAX_LORA_R, f"r={self.r!r} is not a whole number from 1 to {MAX_LORA_R}"),
            (number(self.alpha) and self.alpha > 0, f"alpha={self.alpha!r} is not a positive number"),
            (number(self.dropout) and 0 <= self.dropout < 1, f"dropout={self.dropout!r} is not in [0, 1)"),
            (
                all(names(v) for v in (self.target_modules, self.modules_to_save, self.target_parameters)),
                "a module list is not a list of names",
            ),
            (self.target_regex is None or isinstance(self.target_regex, str), "target_regex is not a string"),
            (isinstance(self.target_linear, bool), f"target_linear={self.target_linear!r} is not true or false"),
            (whole(self.seed), f"seed={self.seed!r} is not a whole number"),
        ]
        problems = [message for ok, message in checks if not ok]
        if problems:
            raise ValueError("; ".join(problems))


def target_paths(model: nn.Module, spec: LoraSpec) -> list[str]:
    """Full module paths of the decoder-layer linears to adapt."""
    parts = decoder_parts(model)
    layers_prefix = next(name for name, m in model.named_modules() if m is parts.layers)
    candidates = [
        name
        for name, module in model.named_modules()
        if name.startswith(layers_prefix + ".") and isinstance(module, nn.Linear) and "lora_" not in name
    ]
    # A pattern may come from a checkpoint: matched with a time limit (``re`` backtracks without end on some).
    by_regex = (
        bounded_regex.fullmatches(spec.target_regex, candidates, what="lora_target_modules")
        if spec.target_regex is not None
        else set()
    )
    paths = [
        name
        for name in candidates
        if spec.target_linear or name.rsplit(".", 1)[-1] in spec.target_modules or name in by_regex
    ]
    if not paths and not (
        spec.target_parameters and not spec.target_modules and not spec.target_linear and spec.target_regex is None
    ):
        wanted = (
            "every linear layer"
            if spec.target_linear
            else f"lora_target_modules={spec.target_regex or spec.target_modules}"
        )
        raise ConfigError(
            f"{wanted} matches no linear layer of the decoder blocks; valid names: "
            f"{sorted({n.rsplit('.', 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})}"
        )
    return paths


def attach_lora(
    model: nn.Module, spec: LoraSpec, *, tp_mesh: DeviceMesh | None, ep_mesh: DeviceMesh | None = None
) -> list[str]:
    """Add adapters to the targets (after tensor parallelism, before FSDP) and freeze everything else."""
    parts = decoder_parts(model)
    layers_prefix = next(name for name, m in model.named_modules() if m is parts.layers)
    paths = target_paths(model, spec)
    for param in model.parameters():
        param.requires_grad_(False)
    for path in paths:
        linear = model.get_submodule(path)
        out_features, in_features = linear.weight.shape  # a DTensor's shape is the global shape
        device = linear.weight.device if not isinstance(linear.weight, DTensor) else linear.weight.to_local().device
        linear.lora_A = nn.Linear(in_features, spec.r, bias=False, device=device)
        linear.lora_B = nn.Linear(spec.r, out_features, bias=False, device=device)
        if device.type != "meta":  # a model with storage: start from the layout-independent init now
            with torch.no_grad():
                for child in ("lora_A", "lora_B"):
                    weight = getattr(linear, child).weight
                    weight.copy_(init_lora_tensor(f"{path}.{child}.weight", tuple(weight.shape), spec.seed, device))
        style = parts.layer_plan.get(path[len(layers_prefix) + 1 :].split(".", 1)[1]) if tp_mesh is not None else None
        # The adapter splits like the layer: B by output columns (colwise), A by input rows (rowwise). A
        # gathered-output layer (colwise_gather) gathers the adapter's output too; a split-input one
        # (rowwise_split) takes its input slice like rowwise.
        split = {"colwise": "colwise", "colwise_gather": "colwise", "rowwise": "rowwise", "rowwise_split": "rowwise"}
        kind = split.get(style) if tp_mesh is not None and tp_mesh.size() > 1 else None
        if kind is not None:
            a_place, b_place = ([Replicate()], [Shard(0)]) if kind == "colwise" else ([Shard(1)], [Replicate()])
            linear.lora_A.weight = nn.Parameter(distribute_tensor(linear.lora_A.weight.data, tp_mesh, a_place))
            linear.lora_B.weight = nn.Parameter(distribute_tensor(linear.lora_B.weight.data, tp_mesh, b_place))
        linear.register_forward_hook(
            _LoraHook(spec.scaling, spec.dropout, rowwise=kind == "rowwise", gather=style == "colwise_gather")
        )
    if spec.target_parameters:
        attach_expert_lora(
            model,
            parts.layers,
            target_parameters=spec.target_parameters,
            r=spec.r,
            scaling=spec.scaling,
            dropout=spec.dropout,
            seed=spec.seed,
            ep_mesh=ep_mesh,
            init=init_lora_tensor,
        )
    for name in spec.modules_to_save:
        matches = [m for n, m in model.named_modules() if n == name or n.endswith("." + name)]
        if not matches:
            raise ConfigError(f"lora_modules_to_save names {name!r}, which the model does not have")
        for module in matches:
            for param in module.parameters():
                param.requires_grad_(True)
    return paths


class _LoraHook:
    def __init__(self, scaling: float, dropout: float, *, rowwise: bool, gather: bool = False) -> None:
        self.scaling, self.dropout, self.rowwise, self.gather = scaling, dropout, rowwise, gather

    def __call__(self, module: nn.Linear, args: tuple, output: torch.Tensor) -> torch.Tensor:
        if not hasattr(module, "lora_A"):  # merged into the base weight
            return output
        x = args[0]
        if self.dropout and module.training:
            x = F.dropout(x, self.dropout)
        low = module.lora_A(x)
        if self.rowwise and isinstance(low, DTensor):
            low = low.redistribute(placements=[Shard(1)])  # partial sums over tp -> sequence-split
        delta = module.lora_B(low) * self.scaling
        if isinstance(delta, DTensor) and not isinstance(output, DTensor):
            delta = (delta.redistribute(placements=[Replicate()]) if self.gather else delta).to_local()
        return output + delta


def init_lora_tensor(key: str, shape: tuple, seed: int, device: torch.device) -> torch.Tensor | None:
    """A: uniform(+-1/sqrt(in)) (peft's default kaiming init); B: zeros, so training starts at the base model."""
    if key.endswith(("lora_B.weight", "_lora_B")):  # linear adapters (out, r); expert adapters (E, out, r)
        return torch.zeros(shape, device=device)
    if key.endswith(("lora_A.weight", "_lora_A")):  # (r, in) or (E, r, in)
        generator = torch.Generator(device=device).manual_seed((seed * 7919 + zlib.crc32(key.encode())) % (2**63))
        bound = 1.0 / math.sqrt(shape[-1])
        return torch.empty(shape, device=device).uniform_(-bound, bound, generator=generator)
    return None


def adapter_weight_count(model: nn.Module) -> int:
    """Trainable LoRA weights in ``model``, linear and expert adapters (a sharded parameter counts its whole
    tensor): what the step's FLOP count charges the adapters for (``step.flops.flops_per_token``)."""
    return sum(p.numel() for name, p in model.named_parameters() if p.requires_grad and "lora_" in name)


def adapter_state(model: nn.Module, spec: LoraSpec) -> dict[str, torch.Tensor]:
    """Full (gathered) adapter and modules_to_save tensors under PEFT's names. A collective under DTensor."""
    out = {}
    to_save = set(spec.modules_to_save)
    for name, param in model.named_parameters():
        clean = _compat.canonical_name(name)
        module_path = clean.rsplit(".", 1)[0]
        is_adapter = ".lora_A." in clean or ".lora_B." in clean
        saved_module = any(module_path == m or module_path.endswith("." + m) for m in to_save)
        if is_adapter or saved_module:
            full = param.full_tensor() if isinstance(param, DTensor) else param
            out[PEFT_PREFIX + clean] = full.detach().cpu().contiguous()
    out.update(expert_adapter_state(model, PEFT_PREFIX))
    return out


def peft_config_dict(spec: LoraSpec, base_model: str | None) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": spec.r,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": spec.target_regex or sorted(set(spec.target_modules)) or "all-linear",
        "modules_to_save": spec.modules_to_save or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "base_model_name_or_path": base_model,
    }


def save_peft_adapter(
    model: nn.Module, spec: LoraSpec, out_dir: Path, *, base_model: str | None = None, write: bool = True
) -> None:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` (call on every rank; ``write`` on one)."""
    from safetensors.torch import save_file

    tensors = adapter_state(model, spec)
    if not write:
        return
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = peft_config_dict(spec, base_model)
    if spec.target_linear and not spec.target_modules and spec.target_regex is None:
        config["target_modules"] = sorted(
            {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in tensors if ".lora_" in k and ".experts." not in k}
        )
    if spec.target_parameters:
        config["target_parameters"] = expert_target_parameters(model)
        if not spec.target_modules and not spec.target_linear and spec.target_regex is None:
            config["target_modules"] = []
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))


def merge_lora_weights(model: nn.Module, spec: LoraSpec) -> None:
    """Fold each adapter into its base weight (W += alpha/r * B @ A) and remove it (one process, plain tensors)."""
    with torch.no_grad():
        for _, module in list(model.named_modules()):
            if isinstance(module, nn.Linear) and hasattr(module, "lora_A"):
                delta = (module.lora_B.weight.float() @ module.lora_A.weight.float()) * spec.scaling
                module.weight.copy_((module.weight.float() + delta).to(module.weight.dtype))
                del module.lora_A, module.lora_B  # the hook now passes the output through
    merge_expert_lora(model)
