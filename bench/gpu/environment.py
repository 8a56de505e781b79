"""What a GPU figure must name: the device, the driver and the versions of everything it ran on, as JSON.

    python -m bench.gpu.environment --output OUT/environment.json
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import shutil
import subprocess
from pathlib import Path

import torch

PACKAGES = ("torch", "transformers", "deepspeed", "peft", "accelerate", "safetensors", "tokenizers", "triton",
            "datasets", "pyarrow", "fsspec", "pydantic", "gguf", "numpy", "pytest")


def package_versions() -> dict[str, str | None]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _command_output(command: list[str]) -> str | None:
    if shutil.which(command[0]) is None:
        return None
    result = subprocess.run(command, capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 else None


def describe() -> dict:
    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name() if cuda else f"{platform.processor() or platform.machine()} CPU",
        "cuda_available": cuda,
        "torch_cuda": torch.version.cuda,
        "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
        "driver": _command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
        "nvcc": _command_output(["nvcc", "--version"]),
        "python": platform.python_version(),
        "cpu_cores": torch.get_num_threads(),
        "versions": package_versions(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    report = describe()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
