"""A model directory's safetensors weights, read tensor by tensor and slice by slice: each rank reads only
the part of each weight it keeps (``get_slice``), and names that point outside the directory are refused."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from ndparallel.errors import ModelError
from ndparallel.models.moe_weights import hub_expert_tensor
from ndparallel.safe_io import file_names
from ndparallel.weights.shards import copy_shard, local_box


class SafetensorsReader:
    """Reads single tensors by name from a model directory's safetensors files (sharded or not)."""

    def __init__(self, directory: str) -> None:
        path = Path(directory)
        index = path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                entries = weight_map.items()
            except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
                raise ModelError(
                    f"{str(index)!r} has no readable weight_map ({type(exc).__name__}); fix or remove the index"
                ) from None
            self.files = {key: self._inside(path, index, key, file) for key, file in entries}
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise ModelError(
                    f"base_model {directory!r} has a config but no *.safetensors weights; add the weights, "
                    f"or use model_shape / model_config_overrides for random init"
                )
            self.files = {}
            for file in files:
                with safe_open(file, framework="pt") as f:
                    for key in f.keys():
                        self.files[key] = file
        missing = sorted({str(f) for f in self.files.values() if not f.is_file()})
        if missing:
            raise ModelError(f"base_model {directory!r}: the index names weight files that are missing: {missing}")
        self.directory = directory
        self.used: set[str] = set()

    @staticmethod
    def _inside(path: Path, index: Path, key: str, name: object) -> Path:
        found = file_names.inside(path, name)
        if found is None:
            raise ModelError(
                f"{str(index)!r} maps {key!r} to {name!r}, which is not a file name inside the model directory "
                f"(no absolute paths or '..'); fix the index"
            )
        return found

    def get(self, key: str) -> torch.Tensor:
        """The whole weight ``key`` (for the few readers that need all of it: stacked experts, grown rows)."""
        if key not in self.files:
            # MoE experts stored one tensor per expert (the Hub layout) for a stacked parameter
            stacked = hub_expert_tensor(key, self.files.__contains__, self.get)
            if stacked is not None:
                return stacked
            raise ModelError(
                f"base_model {self.directory!r}: no weight named {key!r} in its safetensors files "
                f"(is it a checkpoint of another architecture?)"
            )
        self.used.add(key)
        try:
            with safe_open(self.files[key], framework="pt") as f:
                return f.get_tensor(key)
        except Exception as exc:  # a truncated or corrupted file
            raise ModelError(
                f"cannot read {key!r} from {str(self.files[key])!r}: {exc}; the file may be truncated"
            ) from None

    def read_into(self, key: str, param: torch.Tensor) -> None:
        """Fill this rank's part of ``param`` from the weight ``key``: only that slice is read from disk, cast
        to the parameter's dtype on the host, then copied to the parameter's device."""
        if key not in self.files:  # e.g. MoE experts stored one tensor per expert: assembled whole
            copy_shard(param, self.get(key))
            return
        local, box = local_box(param)
        if box is None:  # a placement whose local part is not one box: read it whole, slice in memory
            copy_shard(param, self.read_box(key, tuple(param.shape), None))
        elif local.numel():
            local.copy_(self.read_box(key, tuple(param.shape), box).to(local.dtype))

    def read_box(self, key: str, shape: tuple, box: tuple[slice, ...] | None) -> torch.Tensor:
        """The part ``box`` (None: all) of the weight ``key``, which must have ``shape``; only it is read."""
        self.used.add(key)
        try:
            with safe_open(self.files[key], framework="pt") as f:
                stored = f.get_slice(key)
                if tuple(stored.get_shape()) != shape:
                    raise ModelError(
                        f"{key}: the weights in {self.directory!r} have shape {tuple(stored.get_shape())} but "
                        f"the model expects {shape}; config.json and the weights disagree"
                    )
                return stored[box] if box is not None else stored[:]
        except ModelError:
            raise
        except Exception as exc:  # a truncated or corrupted file
            raise ModelError(
                f"cannot read {key!r} from {str(self.files[key])!r}: {exc}; the file may be truncated"
            ) from None

    def check_all_used(self, *, ignore: set[str]) -> None:
        unused = sorted(set(self.files) - self.used - ignore)
        if unused:
            raise ModelError(
                f"base_model {self.directory!r} holds weights the model does not have: {unused[:5]}"
                f"{' ...' if len(unused) > 5 else ''}; is config.json the right architecture?"
            )
