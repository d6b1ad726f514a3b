"""A frozen input embedding kept in host memory (``embedding_offload``): its table leaves the GPU.

Under LoRA the input embedding is frozen, and a step reads only the rows of its own tokens: 4,096 tokens of an
8B read 32 MiB of a 1 GiB table (128,256 x 4,096 bf16). Kept in pinned host memory, the table costs the GPU
nothing; each step gathers its rows on the host and copies them over (``lookup``), where the GPU would have
gathered them itself. The trainer's rows are on the host already (``step/batching.Batch.input_ids_host``), so the
gather and the copy are queued without waiting for the GPU (``embed_inputs``: the model gets ``inputs_embeds``).
A caller that gives the model token ids on the GPU still gets the same embeddings: the module's own forward
copies the ids to the host first (which waits for the GPU once per forward).

The values are the table's rows as they are (a gather is exact), so a run with the table in host memory is the
run without it, bit for bit. The table stays a parameter of the model (checkpoints, exports and
``state_dict`` see it under its own name); moving the model (``model.to(device)``) leaves it on the host.

Only for one process (FSDP would shard the table), a frozen table (adapters, not in ``lora_modules_to_save``),
not tied to lm_head (the loss reads lm_head's weight on the GPU): ``parallel/rules.embedding_offload_problems``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_MARK = "_ndparallel_host_table"  # an attribute of the table's Parameter (tensors compare by value, not identity)


class HostEmbedding(nn.Embedding):
    """An ``nn.Embedding``'s frozen table in host memory, whose lookups arrive on ``device`` (an ``nn.Embedding``
    still, for whoever initializes or inspects embeddings by type)."""

    def __init__(self, embedding: nn.Embedding, device: torch.device) -> None:
        nn.Module.__init__(self)  # not nn.Embedding's: it would allocate a table
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx, self.max_norm, self.norm_type = embedding.padding_idx, None, embedding.norm_type
        self.scale_grad_by_freq, self.sparse = embedding.scale_grad_by_freq, embedding.sparse
        self.device = device
        self.pinned = device.type == "cuda"
        table = embedding.weight.detach()
        self._set_table(table if table.is_meta else self._host(table.to("cpu")))  # meta: storage comes later

    def _host(self, table: torch.Tensor) -> torch.Tensor:
        return table.pin_memory() if self.pinned else table

    def _set_table(self, table: torch.Tensor) -> None:
        self.weight = nn.Parameter(table, requires_grad=False)
        setattr(self.weight, _MARK, True)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lookup(input_ids.to("cpu"))

    def lookup(self, ids_host: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids_host`` (token ids in host memory) on ``device``; queued, nothing waits."""
        flat = ids_host.reshape(-1)
        rows = torch.empty((flat.numel(), self.embedding_dim), dtype=self.weight.dtype, pin_memory=self.pinned)
        torch.index_select(self.weight, 0, flat, out=rows)
        return rows.view(*ids_host.shape, self.embedding_dim).to(self.device, non_blocking=self.pinned)

    def _apply(self, fn, recurse: bool = True):
        # the table stays where it is (pinned host memory) when the model moves or casts; a table on the meta device
        # (a model built there, given storage by ``to_empty``) gets its storage in host memory
        if self.weight.is_meta:
            self._set_table(self._host(torch.empty(self.weight.shape, dtype=self.weight.dtype)))
        return self

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, in host memory"


def offload_embedding(model: nn.Module, device: torch.device) -> HostEmbedding:
    """Replace ``model``'s input embedding by a ``HostEmbedding`` of the same table (checked by the rules)."""
    host = HostEmbedding(model.get_input_embeddings(), device)
    model.set_input_embeddings(host)
    return host


def is_host_table(param: torch.Tensor) -> bool:
    """A ``HostEmbedding``'s table: used where it is (no flat buffer, no FSDP shard takes it to the GPU)."""
    return getattr(param, _MARK, False)


def host_embedding_of(model: nn.Module) -> HostEmbedding | None:
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    return embedding if isinstance(embedding, HostEmbedding) else None


def embed_inputs(model: nn.Module, inputs: dict[str, Any], ids_host: torch.Tensor | None) -> dict[str, Any]:
    """``inputs`` for the model's forward, with ``inputs_embeds`` looked up from ``ids_host`` in place of the
    device's ``input_ids`` when the model's embedding is in host memory (unchanged otherwise)."""
    host = host_embedding_of(model)
    if host is None or ids_host is None:
        return inputs
    embedded = {k: v for k, v in inputs.items() if k != "input_ids"}
    embedded["inputs_embeds"] = host.lookup(ids_host)
    return embedded
