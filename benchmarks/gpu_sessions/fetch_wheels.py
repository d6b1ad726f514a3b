"""Download the wheels the GPU sessions carry (the GPU machine has no network), into .whl/ and .whl_unsloth/.

    python3 benchmarks/gpu_sessions/fetch_wheels.py          # from the repository root; ~52 MiB in all

.whl/ holds pydantic (and its dependencies), torchao 0.18 and liger-kernel; .whl_unsloth/ holds Unsloth and what
it needs beyond the GPU image's packages (KINDS.md lists them). Two things keep the pair under run's 64 MiB:
- torch and transformers are already on the machine, so pip resolves against stand-in wheels of the machine's
  versions (otherwise it fetches torch's CUDA libraries); large packages the image holds are then left out;
- bitsandbytes keeps only its CUDA 13.0 library, and Unsloth drops its Studio web front end (not imported by
  training).
Both folders are git-excluded; add them to `carry` (gpu_finetune.sh installs them).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

MACHINE_TORCH = "2.11.0+cu130"
MACHINE_TRANSFORMERS = "5.17.0"
PLATFORM_ARGS = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"] + [
    arg
    for tag in (
        "manylinux_2_28_x86_64",
        "manylinux_2_27_x86_64",
        "manylinux_2_24_x86_64",
        "manylinux_2_17_x86_64",
        "manylinux2014_x86_64",
        "manylinux1_x86_64",
    )
    for arg in ("--platform", tag)
]
BASE_NO_DEPS = ["torchao==0.18.0", "liger-kernel==0.8.5"]  # their dependencies are on the machine
BASE_WITH_DEPS = ["pydantic>=2.6"]
UNSLOTH = [
    "unsloth==2026.10.9",
    "unsloth_zoo==2026.10.9",
    "bitsandbytes==0.50.2",
    "peft==0.21.0",
    "trl",
    "datasets",
    "diffusers",
    "tyro",
    "hf_transfer",
    "cut_cross_entropy",
    "json5",
    "nest-asyncio",
    "structlog",
]
# On the GPU image already (KINDS.md) and too large to carry again; also what .whl/ holds.
LEFT_OUT = {
    "torch", "triton", "transformers", "pyarrow", "numpy", "pandas", "torchvision", "pillow", "xformers",
    "hf_xet", "tokenizers", "torchao", "pydantic", "pydantic_core", "annotated_types", "typing_inspection",
    "typing_extensions", "liger_kernel",
}  # fmt: skip


def _stand_in(folder: Path, name: str, version: str) -> None:
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")


def _trimmed(source: Path, target: Path, drop: re.Pattern[str]) -> None:
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as new:
        for entry in old.infolist():
            if drop.search(entry.filename):
                continue
            data = old.read(entry)
            if entry.filename.endswith(".dist-info/RECORD"):
                kept = [line for line in data.decode().splitlines() if not drop.search(line.split(",")[0])]
                data = ("\n".join(kept) + "\n").encode()
            new.writestr(entry, data)


TRIMS = {
    "bitsandbytes": re.compile(r"libbitsandbytes_(cuda(?!130)|rocm)"),
    "unsloth": re.compile(r"^studio/frontend/"),
}


def _download(args: list[str], into: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", *PLATFORM_ARGS, "-d", str(into), *args], check=True)


def main() -> None:
    base, unsloth = Path(".whl"), Path(".whl_unsloth")
    for folder in (base, unsloth):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
    _download(["--no-deps", *BASE_NO_DEPS], base)
    _download(BASE_WITH_DEPS, base)
    with tempfile.TemporaryDirectory() as scratch:
        stand_ins, everything = Path(scratch, "stand_ins"), Path(scratch, "all")
        stand_ins.mkdir()
        _stand_in(stand_ins, "torch", MACHINE_TORCH)
        _stand_in(stand_ins, "transformers", MACHINE_TRANSFORMERS)
        pins = [f"torch=={MACHINE_TORCH.split('+')[0]}", f"transformers=={MACHINE_TRANSFORMERS}"]
        _download(["--find-links", str(stand_ins), *UNSLOTH, *pins], everything)
        for wheel in sorted(everything.glob("*.whl")):
            name = wheel.name.split("-")[0].lower()
            if name in LEFT_OUT:
                continue
            if name in TRIMS:
                _trimmed(wheel, unsloth / wheel.name, TRIMS[name])
            else:
                shutil.copy(wheel, unsloth / wheel.name)
    total = sum(f.stat().st_size for folder in (base, unsloth) for f in folder.iterdir())
    print(f"{len(list(base.iterdir()))} + {len(list(unsloth.iterdir()))} wheels, {total / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
