"""Convert the embedded model now (once per machine, into RLHF_CACHE_DIR) and write its folder's path to a file,
which the GPU runner reads without importing the project (it runs before DeepSpeed is installed).

    python -m bench.gpu.convert PATH_FILE
"""
from __future__ import annotations

import argparse
from pathlib import Path

from training.core.embedded_model import embedded_model_path
from utils.errors import run_cli


@run_cli
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path_file", type=Path)
    args = parser.parse_args(argv)
    folder = embedded_model_path()
    args.path_file.parent.mkdir(parents=True, exist_ok=True)
    args.path_file.write_text(folder)
    print(f"embedded model: {folder}")


if __name__ == "__main__":
    main()
