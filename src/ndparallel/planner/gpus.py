"""GPU presets: what a datasheet says about each accelerator (``ndparallel plan --gpu``).

Peak rates are dense (no sparsity), per GPU, from the vendors' datasheets; memory is what PyTorch reports
as the device's capacity (``torch.cuda.get_device_properties().total_memory``: HBM stacks are sized in
GiB, less what the driver keeps). Link speeds are per GPU per direction in GB/s (1e9 bytes): the
GPU-to-GPU fabric inside a node (NVLink / Infinity Fabric; PCIe when a card has none) and the typical
network of a training cluster with that GPU (one 400 Gb/s NIC per GPU = 50 GB/s). Host memory and the
host link matter only for activation offload (``parallel/offload.py``): the host memory per GPU of a usual
server with that GPU (the conservative configuration where vendors sell several; ``--host-memory-gib`` gives a
node's own) and the PCIe generation of the card's host link, per direction.

How much of a peak the kernels of a training step reach is not a datasheet number: ``rates.py`` holds
fractions measured on our H200 and applies them to every preset (an assumption outside Hopper, said
so in the plan's header), and ``ndparallel plan --measure`` replaces them with timings on your GPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ndparallel.errors import ConfigError


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator as the planner sees it."""

    key: str
    """Preset name, e.g. 'h100-sxm'."""
    name: str
    memory_gib: float
    bf16_tflops: float
    """Dense bf16 tensor-core peak."""
    fp8_tflops: float | None
    """Dense fp8 tensor-core peak; None when the GPU has no fp8 units."""
    fp32_tflops: float
    """Plain fp32 (CUDA cores): what fp32 matmuls run at, since torch leaves TF32 off by default."""
    hbm_gbps: float
    """Device memory bandwidth, GB/s."""
    intra_node_gbps: float
    """GPU-to-GPU bandwidth inside a node, per direction."""
    inter_node_gbps: float
    """Network bandwidth per GPU per direction."""
    arch: str
    """'hopper', 'ampere', 'ada', 'blackwell', 'cdna3': whether the H200-measured efficiencies are a close guess."""
    host_memory_gib: float = 128.0
    """Host memory per GPU of a usual server with this GPU (a node of k GPUs: k times this)."""
    host_link_gbps: float = 64.0
    """GPU-to-host bandwidth per direction, GB/s (PCIe Gen5 x16: 64; Gen4: 32): what offloaded activations cross."""

    def with_overrides(self, **values: float | None) -> "GpuSpec":
        """A copy with the given fields replaced (None values are ignored); named 'custom' if any changed."""
        changed = {k: v for k, v in values.items() if v is not None and getattr(self, k) != v}
        for field, value in changed.items():
            if not value > 0:
                raise ConfigError(f"{field}={value!r} must be > 0")
        if not changed:
            return self
        return dataclasses.replace(self, **changed, key=f"{self.key} (modified)")


GPUS: dict[str, GpuSpec] = {
    spec.key: spec
    for spec in (
        # NVIDIA H100 SXM5 80GB: 989 TFLOP/s bf16, 1979 fp8, 67 fp32, 3.35 TB/s; NVLink 4 900 GB/s both ways.
        # Host: PCIe Gen5 x16; 128 GiB per GPU (1 TiB per 8-GPU node; DGX H100 ships 2 TB).
        GpuSpec("h100-sxm", "NVIDIA H100 SXM 80GB", 79.1, 989.0, 1979.0, 67.0, 3350.0, 450.0, 50.0, "hopper"),
        # NVIDIA H100 PCIe 80GB: 756 bf16, 1513 fp8, 51 fp32, 2.0 TB/s; PCIe Gen5 x16 between cards (~64 GB/s
        # per direction; NVLink bridges join pairs only, not modelled).
        GpuSpec("h100-pcie", "NVIDIA H100 PCIe 80GB", 79.1, 756.0, 1513.0, 51.0, 2000.0, 64.0, 25.0, "hopper"),
        # NVIDIA H200 SXM 141GB: the H100 SXM's compute with 4.8 TB/s HBM3e (torch reports 139.8 GiB); host as the
        # H100's (the H200 machine the planner was measured on: one GPU, 128 GiB of host memory).
        GpuSpec("h200", "NVIDIA H200 SXM 141GB", 139.8, 989.0, 1979.0, 67.0, 4800.0, 450.0, 50.0, "hopper"),
        # NVIDIA A100 SXM4: 312 bf16, no fp8, 19.5 fp32; NVLink 3 600 GB/s both ways; HDR 200 Gb/s per GPU.
        # Host: PCIe Gen4 x16; DGX A100: 1 TB for 8 GPUs.
        GpuSpec(
            "a100-80gb", "NVIDIA A100 SXM 80GB", 79.2, 312.0, None, 19.5, 2039.0, 300.0, 25.0, "ampere", 116.4, 32.0
        ),
        GpuSpec(
            "a100-40gb", "NVIDIA A100 SXM 40GB", 39.4, 312.0, None, 19.5, 1555.0, 300.0, 25.0, "ampere", 116.4, 32.0
        ),
        # NVIDIA B200 (HGX, 180 GB): 2250 bf16, 4500 fp8, 8 TB/s; NVLink 5 1.8 TB/s both ways. Host: PCIe Gen5;
        # DGX B200: 2 TB for 8 GPUs.
        GpuSpec("b200", "NVIDIA B200 180GB", 178.4, 2250.0, 4500.0, 75.0, 8000.0, 900.0, 50.0, "blackwell", 232.8),
        # NVIDIA L40S 48GB GDDR6: 362 bf16, 733 fp8, 91.6 fp32, 864 GB/s; no NVLink (PCIe Gen4 ~32 GB/s).
        # Host: 512 GB per 8-card server.
        GpuSpec("l40s", "NVIDIA L40S 48GB", 44.4, 362.0, 733.0, 91.6, 864.0, 32.0, 12.5, "ada", 59.6, 32.0),
        # AMD Instinct MI300X 192GB: 1307 bf16, 2615 fp8, 163 fp32, 5.3 TB/s; Infinity Fabric, 7 links of 64
        # GB/s per direction to the other 7 GPUs (448 GB/s when a collective spans all 8; less for fewer).
        # Host: PCIe Gen5 x16; 1.5 TB per 8-GPU platform.
        GpuSpec(
            "mi300x", "AMD Instinct MI300X 192GB", 191.5, 1307.0, 2615.0, 163.0, 5300.0, 448.0, 50.0, "cdna3", 174.6
        ),
    )
}

DEFAULT_GPU = "h100-sxm"


def gpu_preset(key: str) -> GpuSpec:
    """The preset named ``key`` (case-insensitive)."""
    spec = GPUS.get(key.strip().lower())
    if spec is None:
        raise ConfigError(f"gpu={key!r} is not a preset; choose one of {', '.join(GPUS)} (or --measure on the GPU)")
    return spec


def preset_for_device_name(device_name: str, memory_gib: float) -> GpuSpec | None:
    """The preset that matches a device name as CUDA reports it (e.g. 'NVIDIA H200'), memory included."""
    text = device_name.upper()
    candidates = [
        ("H200", "h200"),
        ("H100 PCIE", "h100-pcie"),
        ("H100", "h100-sxm"),
        ("B200", "b200"),
        ("L40S", "l40s"),
        ("MI300X", "mi300x"),
        ("A100", "a100-80gb" if memory_gib > 50 else "a100-40gb"),
    ]
    for needle, key in candidates:
        if needle in text:
            return dataclasses.replace(GPUS[key], memory_gib=round(memory_gib, 1))
    return None
