"""Mirror a git checkout into a persistent build directory, rewriting only the files whose content
changed (`python tools/sync_tree.py CHECKOUT MIRROR`).

Cargo decides what to rebuild from file modification times (and keys its fingerprints by each
crate's path relative to the workspace). A fresh clone gives every file a new mtime, so on a machine
whose cargo target directory persists between CI runs, every workspace crate was compiled again on
every run although its sources had not changed. `tools/test.sh` builds from one mirror instead: an
unchanged file keeps its old mtime there, a changed file is written anew (so its mtime is now, later
than any build), and a file the checkout no longer has is deleted: cargo then rebuilds exactly the
crates whose sources differ from the last build, as it would in a long-lived checkout.

The files mirrored are git's: tracked ones still on disk plus untracked ones that are not ignored
(`git ls-files --cached --others --exclude-standard`), so uncommitted work is built too. Symlinks
are mirrored as symlinks.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from pathlib import Path


def checkout_files(checkout: Path) -> set[str]:
    """Relative paths of the files git would build from in `checkout` (tracked and present, or
    untracked and not ignored)."""
    listing = subprocess.run(
        ["git", "-C", str(checkout), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True,
        capture_output=True,
    ).stdout
    names = {name for name in listing.decode().split("\0") if name}
    # A tracked path deleted (or turned into a directory) in the work tree is not built from.
    return {name for name in names if (checkout / name).is_symlink() or (checkout / name).is_file()}


def same_entry(source: Path, target: Path) -> bool:
    """Whether `target` already is what `source` is: the same symlink, or a file of equal bytes."""
    if source.is_symlink() or target.is_symlink():
        return source.is_symlink() and target.is_symlink() and os.readlink(source) == os.readlink(target)
    if not target.is_file() or source.stat().st_size != target.stat().st_size:
        return False
    return source.read_bytes() == target.read_bytes()


def copy_entry(source: Path, target: Path) -> None:
    """Write `target` as `source`, with a new mtime (the content changed after any earlier build)."""
    if target.is_dir() and not target.is_symlink():
        shutil.rmtree(target)
    elif os.path.lexists(target):
        target.unlink()
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.is_symlink():
        os.symlink(os.readlink(source), target)
    else:
        shutil.copyfile(source, target)  # contents only: the new file's mtime is now
        shutil.copymode(source, target)


def remove_stale(mirror: Path, keep: set[str]) -> int:
    """Delete what `mirror` holds beyond `keep` (files, symlinks, then emptied directories)."""
    removed = 0
    for root, dirs, files in os.walk(mirror, topdown=False):
        base = Path(root)
        for name in files + [d for d in dirs if (base / d).is_symlink()]:
            path = base / name
            if path.relative_to(mirror).as_posix() not in keep:
                path.unlink()
                removed += 1
        for name in dirs:
            path = base / name
            if not path.is_symlink() and path.is_dir() and not any(path.iterdir()):
                path.rmdir()
    return removed


def sync(checkout: Path, mirror: Path) -> tuple[int, int]:
    """Make `mirror` hold exactly `checkout`'s files; returns (files written, entries removed)."""
    files = checkout_files(checkout)
    mirror.mkdir(parents=True, exist_ok=True)
    removed = remove_stale(mirror, files)  # first: a stale file may stand where a directory goes
    written = 0
    for name in sorted(files):
        source, target = checkout / name, mirror / name
        if not same_entry(source, target):
            copy_entry(source, target)
            written += 1
    return written, removed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path)
    parser.add_argument("mirror", type=Path)
    args = parser.parse_args()
    written, removed = sync(args.checkout.resolve(), args.mirror.resolve())
    print(f"{args.mirror}: {written} files written, {removed} removed")


if __name__ == "__main__":
    main()
