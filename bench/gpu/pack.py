"""Fit a GPU call's output folder to what the device tool brings back (at most 8 files of 16 MiB, no deep
folders): every report and log into one `gpu_run.tar.gz`, with `status.json` beside it; and copying a run
folder's reports (not its model weights) into the output.

    python -m bench.gpu.pack reports RUN_DIR OUT/train
"""
from __future__ import annotations

import argparse
import shutil
import tarfile
from pathlib import Path

ARCHIVE = "gpu_run.tar.gz"
KEPT_BESIDE = ("status.json",)
REPORT_SUFFIXES = (".json", ".jsonl", ".log", ".txt", ".png", ".xml")
MAX_REPORT_BYTES = 4 << 20


def pack(out: Path) -> Path:
    """Move everything in `out` but `KEPT_BESIDE` into `out/ARCHIVE` (paths relative to `out`)."""
    archive = out / ARCHIVE
    members = sorted(path for path in out.iterdir() if path.name not in (*KEPT_BESIDE, ARCHIVE))
    with tarfile.open(archive, "w:gz") as tar:
        for member in members:
            tar.add(member, arcname=member.name)
    for member in members:
        shutil.rmtree(member) if member.is_dir() else member.unlink()
    return archive


def copy_reports(run_dir: Path, destination: Path) -> list[Path]:
    """Copy the run folder's reports (`REPORT_SUFFIXES`, each under `MAX_REPORT_BYTES`), keeping their layout; not
    the files of a saved model (a folder holding config.json: its tokenizer.json alone is 3.4 MiB for SmolLM2)."""
    copied = []
    for path in sorted(run_dir.rglob("*")):
        if (path.is_file() and path.suffix in REPORT_SUFFIXES and path.stat().st_size <= MAX_REPORT_BYTES
                and not (path.parent / "config.json").is_file()):
            target = destination / path.relative_to(run_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
            copied.append(target)
    return copied


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    reports = commands.add_parser("reports", help="copy a run folder's reports, not its weights")
    reports.add_argument("run_dir", type=Path)
    reports.add_argument("destination", type=Path)
    args = parser.parse_args(argv)
    print(f"copied {len(copy_reports(args.run_dir, args.destination))} reports into {args.destination}")


if __name__ == "__main__":
    main()
