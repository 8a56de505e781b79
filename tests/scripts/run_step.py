"""Run a step's main.py, optionally freezing it in the middle of writing one resume checkpoint.

    python tests/scripts/run_step.py --stall_save_at N --stall_file F SCRIPT -- ARGS...

With `--stall_save_at N` the process writes checkpoint N's engine files, RNG and client state into
the staging folder, creates F and then sleeps instead of writing the completion marker: the test
kills it there to show that a save cut off part-way is never resumed from.
"""
import argparse
import runpy
import sys
import time
from pathlib import Path

from training.reliability import checkpointing


def stall_before_marker(step: int, stall_file: Path) -> None:
    write_text = checkpointing.atomic_write_text

    def write(path, text: str) -> None:
        if Path(path).name == checkpointing.MARKER_FILE and f'"step": {step},' in text:
            stall_file.write_text(str(path))
            time.sleep(3600)
        write_text(path, text)

    checkpointing.atomic_write_text = write


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stall_save_at", type=int)
    parser.add_argument("--stall_file", type=Path)
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    options = parser.parse_args()
    if options.stall_save_at is not None:
        stall_before_marker(options.stall_save_at, options.stall_file)
    args = options.args[1:] if options.args[:1] == ["--"] else options.args
    sys.argv = [options.script, *args]
    runpy.run_path(options.script, run_name="__main__")


if __name__ == "__main__":
    main()
