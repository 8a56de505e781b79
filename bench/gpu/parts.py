"""A file too large for one device call, split into parts with a sha256 manifest and joined back there.

    python -m bench.gpu.parts gather ARRIVED_DIR STASH_DIR OUTPUT

The manifest (`NAME.manifest.json` beside the parts) names the whole file, its size and sha256, and each part's
name, size and sha256, so a part that arrived damaged or not at all is named before anything is joined. Parts
arrive over several device calls: `gather` copies whatever arrived into a stash that outlives the call's working
tree, and joins the file once every part is there.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

_CHUNK = 1 << 20


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class Part:
    name: str
    size: int
    sha256: str

    def is_whole(self, path: Path) -> bool:
        return path.is_file() and path.stat().st_size == self.size and sha256_of(path) == self.sha256


@dataclass(frozen=True)
class Manifest:
    file: str
    size: int
    sha256: str
    parts: tuple[Part, ...]

    @classmethod
    def read(cls, path: Path) -> "Manifest":
        data = json.loads(path.read_text())
        return cls(data["file"], data["size"], data["sha256"], tuple(Part(**part) for part in data["parts"]))

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    def missing(self, parts_dir: Path) -> list[str]:
        """The parts not (yet) whole in `parts_dir`: absent, short, or another sha256 than the manifest's."""
        return [part.name for part in self.parts if not part.is_whole(parts_dir / part.name)]


def manifest_path(parts_dir: Path, file_name: str) -> Path:
    return parts_dir / f"{file_name}.manifest.json"


def split_file(path: Path, parts_dir: Path, max_part_bytes: int) -> Manifest:
    """Cut `path` into parts of at most `max_part_bytes` in `parts_dir` (`NAME.part1`, ...) and write the manifest."""
    if max_part_bytes < 1:
        raise ValueError("max_part_bytes must be positive")
    parts_dir.mkdir(parents=True, exist_ok=True)
    parts = []
    with path.open("rb") as source:
        while chunk := source.read(max_part_bytes):
            part = parts_dir / f"{path.name}.part{len(parts) + 1}"
            part.write_bytes(chunk)
            parts.append(Part(part.name, len(chunk), hashlib.sha256(chunk).hexdigest()))
    manifest = Manifest(path.name, path.stat().st_size, sha256_of(path), tuple(parts))
    manifest.write(manifest_path(parts_dir, path.name))
    return manifest


def join_parts(manifest: Manifest, parts_dir: Path, output: Path) -> Path:
    """Check every part, join them into `output` and check the whole; raise ValueError naming what is wrong."""
    missing = manifest.missing(parts_dir)
    if missing:
        raise ValueError(f"parts missing, incomplete or damaged (sha256) in {parts_dir}: {', '.join(missing)}")
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(output.name + ".joining")
    with partial.open("wb") as joined:
        for part in manifest.parts:
            with (parts_dir / part.name).open("rb") as handle:
                while chunk := handle.read(_CHUNK):
                    joined.write(chunk)
    if sha256_of(partial) != manifest.sha256:
        partial.unlink()
        raise ValueError(f"the joined {manifest.file} does not have the manifest's sha256")
    partial.replace(output)
    return output


def gather(arrived: Path, stash: Path, output: Path) -> list[str]:
    """Copy the manifest and parts in `arrived` into `stash` (a part already stashed whole is kept; one stashed
    damaged is replaced), then join into `output` when every part is there; returns the parts still missing (none:
    `output` is joined). A part that arrived damaged is a ValueError naming it, in the call that carried it."""
    stash.mkdir(parents=True, exist_ok=True)
    manifests = sorted(arrived.glob("*.manifest.json")) or sorted(stash.glob("*.manifest.json"))
    if len(manifests) != 1:
        raise ValueError(f"expected one *.manifest.json in {arrived} or {stash}, found {len(manifests)}")
    manifest = Manifest.read(manifests[0])
    if manifests[0].parent != stash:
        shutil.copyfile(manifests[0], stash / manifests[0].name)
    needed = set(manifest.missing(stash))
    for part in manifest.parts:
        if part.name in needed and (arrived / part.name).is_file():
            if not part.is_whole(arrived / part.name):
                raise ValueError(f"{part.name} arrived damaged (its size or sha256 differs from the manifest); "
                                 "carry it again")
            shutil.copyfile(arrived / part.name, stash / part.name)
    missing = manifest.missing(stash)
    if not missing and not (output.is_file() and sha256_of(output) == manifest.sha256):
        join_parts(manifest, stash, output)
    return missing


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("gather", help="stash the parts that arrived; join once all are there")
    command.add_argument("arrived", type=Path)
    command.add_argument("stash", type=Path)
    command.add_argument("output", type=Path)
    args = parser.parse_args(argv)
    try:
        missing = gather(args.arrived, args.stash, args.output)
    except ValueError as error:
        raise SystemExit(f"error: {error}")
    if missing:
        print(f"stashed in {args.stash}; still missing: {', '.join(missing)}")
    else:
        print(f"joined {args.output} (sha256 checked)")


if __name__ == "__main__":
    main()
