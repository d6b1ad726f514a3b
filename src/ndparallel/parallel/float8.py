"""FP8 training of linear layers with torchao's float8 recipes (``fp8: true``).

Each chosen ``nn.Linear`` becomes torchao's ``Float8Linear``: its input, weight and output gradient are
cast to float8 with dynamic scales and the three matrix products of forward and backward run on the
GPU's FP8 tensor cores (e4m3 forward, e5m2 gradients). Master weights, gradients, optimizer state and
everything that is not one of these products stay as they were (fp32 masters, bf16 compute).

Which linears (a rule the user can change, ``Fp8Spec``):
* kept in bf16: modules whose name matches ``keep_bf16_modules`` (fnmatch; default the output head,
  whose logits feed the loss directly), every linear of the decoder layers in ``keep_bf16_layers``
  (default the first and the last: the layers next to the embedding and the head are the most
  sensitive to rounding), and linears where a dimension is not a multiple of 16 (an FP8 hardware
  requirement) or the smaller of in/out features is below ``min_features`` (default 2048: there the
  casts cost more than the faster product saves; torchao's own heuristic is similar);
* everything else in FP8.

Composition (``parallelize`` calls ``convert_to_fp8`` before tensor parallelism):
* tensor parallelism: converted linears take torchao's ``Float8ColwiseParallel`` /
  ``Float8RowwiseParallel`` (tensorwise recipe only; the gradients between ranks are cast once);
* FSDP2: with the tensorwise recipe and weights sharded over more than one rank, weights are
  all-gathered in float8 (half the bytes of bf16); their scales are computed for all weights in one
  all-reduce after each optimizer step (``fp8_post_step_hook``);
* context parallelism acts on attention, not on linears: nothing to adapt;
* one rank (no FSDP): ``Float8Linear`` casts the bf16 compute copies.

torchao is an optional dependency (``pip install 'ndparallel[fp8]'``); FP8 needs an NVIDIA GPU of
compute capability 8.9 or newer (Ada, Hopper, Blackwell). ``emulate=True`` is torchao's emulation
(values rounded to float8, products in high precision) for CPUs and tests.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch
from torch import nn

from ndparallel import _compat
from ndparallel.errors import ConfigError
from ndparallel.models.decoder import DecoderParts

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


@dataclass(frozen=True)
class Fp8Spec:
    """Which linears train in FP8 and how (see the module docstring)."""

    recipe: str = "tensorwise"
    """torchao recipe: 'tensorwise' (one scale per tensor; fastest, needed for float8 all-gather and TP),
    'rowwise' (one scale per row: more accurate), 'rowwise_with_gw_hp' (rowwise, weight gradient in bf16)."""
    keep_bf16_layers: tuple[int, ...] = (0, -1)
    """Decoder layers (indices; negative counts from the end) whose linears stay in bf16."""
    keep_bf16_modules: tuple[str, ...] = ("lm_head",)
    """Module-name patterns (fnmatch, names as in the model's state_dict) that stay in bf16."""
    min_features: int = 2048
    """Linears whose in or out features are below this stay in bf16."""
    fsdp_float8_all_gather: bool | None = None
    """All-gather FSDP weights in float8: None = when it helps (tensorwise, weights sharded over > 1 rank)."""
    emulate: bool = False
    """torchao's emulation: float8 rounding, high-precision products (CPU, tests); no hardware check."""

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ConfigError(
                f"fp8_recipe={self.recipe!r} is not a torchao float8 recipe; use one of {', '.join(RECIPES)}"
            )
        if self.min_features < 16:
            raise ConfigError(
                f"fp8_min_features={self.min_features} must be >= 16 (FP8 matrix products need "
                f"dimensions that are multiples of 16)"
            )


def check_fp8_supported(device: torch.device, spec: Fp8Spec) -> None:
    """Raise one ``ConfigError`` line unless torchao is installed and this device has FP8 tensor cores."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise ConfigError(
            "fp8: true needs torchao; install it with pip install 'ndparallel[fp8]' (or set fp8: false)"
        ) from None
    if spec.emulate:
        return
    if device.type != "cuda":
        raise ConfigError(
            f"fp8: true needs an NVIDIA GPU with FP8 tensor cores (compute capability >= 8.9), but this "
            f"run is on {device.type}; set fp8: false"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ConfigError(
            f"fp8: true needs compute capability >= 8.9 (Ada, Hopper or newer), but "
            f"{torch.cuda.get_device_name(device)} has {major}.{minor}; set fp8: false"
        )


def fp8_linear_names(parts: DecoderParts, spec: Fp8Spec) -> list[str]:
    """Names of the linears ``spec`` converts (the rule, without converting anything)."""
    model = parts.model
    names = {id(m): _compat.canonical_name(n) for n, m in model.named_modules()}
    n_layers = len(parts.layers)
    kept_layers = {i % n_layers for i in spec.keep_bf16_layers if -n_layers <= i < n_layers}
    kept = {id(m) for i in kept_layers for m in parts.layers[i].modules()}
    chosen = []
    for module in model.modules():
        if not isinstance(module, nn.Linear) or id(module) in kept:
            continue
        name = names[id(module)]
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in spec.keep_bf16_modules):
            continue
        out_features, in_features = module.weight.shape
        if in_features % 16 or out_features % 16 or min(in_features, out_features) < spec.min_features:
            continue
        chosen.append(name)
    return chosen


def convert_to_fp8(parts: DecoderParts, spec: Fp8Spec, *, fsdp_size: int) -> list[str]:
    """Swap the chosen linears for ``Float8Linear`` in place; returns their names.

    ``fsdp_size``: ranks the weights will be sharded over (float8 all-gather only when > 1).
    """
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    chosen = set(fp8_linear_names(parts, spec))
    all_gather = spec.fsdp_float8_all_gather
    if all_gather is None:
        all_gather = spec.recipe == "tensorwise" and fsdp_size > 1
    if all_gather and spec.recipe != "tensorwise":
        raise ConfigError(
            f"fp8_enable_fsdp_float8_all_gather works with fp8_recipe: tensorwise only (not "
            f"{spec.recipe!r}); set it to false or use the tensorwise recipe"
        )
    config = Float8LinearConfig.from_recipe_name(spec.recipe)
    config = _with(config, enable_fsdp_float8_all_gather=bool(all_gather and fsdp_size > 1), emulate=spec.emulate)
    names = {id(m): _compat.canonical_name(n) for n, m in parts.model.named_modules()}
    convert_to_float8_training(
        parts.model, config=config, module_filter_fn=lambda module, _fqn: names.get(id(module)) in chosen
    )
    return sorted(chosen)


def _with(config, **changes):
    import dataclasses

    return dataclasses.replace(config, **changes)


def is_float8_linear(module: nn.Module) -> bool:
    return type(module).__name__ == "Float8Linear" and type(module).__module__.startswith("torchao.")


def tp_style_classes(module: nn.Module) -> tuple[type, type]:
    """(colwise, rowwise) tensor-parallel style classes for ``module``: torchao's float8 ones for a
    converted linear, torch's otherwise."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if not is_float8_linear(module):
        return ColwiseParallel, RowwiseParallel
    if module.config.cast_config_input.scaling_granularity.value != "tensorwise":
        raise ConfigError(
            "fp8 with tensor parallelism needs fp8_recipe: tensorwise (torchao's float8 tensor-parallel "
            "styles assume one scale per tensor); use it, or tp_size: 1"
        )
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    return Float8ColwiseParallel, Float8RowwiseParallel


def fp8_post_step_hook(model: nn.Module):
    """An optimizer step post-hook that precomputes the float8 scales of FSDP-sharded weights (one
    all-reduce for all of them), or None when no weight is all-gathered in float8."""
    from torch.distributed.tensor import DTensor

    uses = any(
        is_float8_linear(m)
        and isinstance(m.weight, DTensor)
        and type(m.weight.to_local()).__name__ == "WeightWithDynamicFloat8CastTensor"
        for m in model.modules()
    )
    if not uses:
        return None
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    def hook(optimizer, args, kwargs) -> None:
        precompute_float8_dynamic_scale_for_fsdp(model)

    return hook
