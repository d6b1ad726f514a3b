"""Print which torch / transformers APIs ndparallel relies on exist in this environment."""

import inspect

import torch
import transformers
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

print("torch", torch.__version__, "transformers", transformers.__version__)
for name in ("_flatten", "_concatenate", "_unflatten"):
    print(f"DeviceMesh.{name}:", hasattr(DeviceMesh, name))
for name in ("set_gradient_divide_factor", "set_force_sum_reduction_for_comms", "set_requires_gradient_sync"):
    print(f"FSDPModule.{name}:", hasattr(FSDPModule, name))
print("fully_shard params:", list(inspect.signature(fully_shard).parameters))
print("get_total_norm:", hasattr(torch.nn.utils, "get_total_norm"))
for op in (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention_backward",
):
    print(op, getattr(torch.ops.aten, op).default._schema)
from transformers import PreTrainedModel  # noqa: E402
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface  # noqa: E402,F401

print("set_attn_implementation:", hasattr(PreTrainedModel, "set_attn_implementation"))
from transformers.models.llama import modeling_llama  # noqa: E402

print("LlamaModel.forward params:", list(inspect.signature(modeling_llama.LlamaModel.forward).parameters))
