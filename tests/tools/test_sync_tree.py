"""tools/sync_tree.py: the build mirror keeps an unchanged file's mtime (so cargo does not rebuild its
crate), rewrites a changed one with a new mtime, and drops what the checkout no longer has."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OLD = 1_000_000_000  # 2001: earlier than any build


def load_sync_tree():
    spec = importlib.util.spec_from_file_location("sync_tree", REPO / "tools" / "sync_tree.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["sync_tree"] = module
    spec.loader.exec_module(module)
    return module


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def make_checkout(root: Path) -> Path:
    checkout = root / "checkout"
    (checkout / "rust" / "src").mkdir(parents=True)
    (checkout / "rust" / "src" / "lib.rs").write_text("pub fn one() -> u32 { 1 }\n")
    (checkout / "rust" / "src" / "gone.rs").write_text("// deleted later\n")
    (checkout / "csrc").mkdir()
    (checkout / "csrc" / "k.cu").write_text("// kernel\n")
    (checkout / "link").symlink_to("csrc")
    (checkout / ".gitignore").write_text("*.so\n")
    git(checkout.parent, "init", "-q", str(checkout))
    git(checkout, "add", ".")
    return checkout


def mtime(path: Path) -> int:
    return int(path.lstat().st_mtime)


def test_unchanged_files_keep_their_mtime_changed_ones_are_rewritten_and_stale_ones_go(
    tmp_path: Path,
) -> None:
    sync_tree = load_sync_tree()
    checkout, mirror = make_checkout(tmp_path), tmp_path / "mirror"
    assert sync_tree.sync(checkout, mirror) == (5, 0)
    assert (mirror / "link").is_symlink() and os.readlink(mirror / "link") == "csrc"
    for name in ("rust/src/lib.rs", "rust/src/gone.rs", "csrc/k.cu", ".gitignore"):
        os.utime(mirror / name, (OLD, OLD))
    (mirror / "stray" / "deep").mkdir(parents=True)
    (mirror / "stray" / "deep" / "old.rs").write_text("// left by an earlier checkout\n")

    (checkout / "rust" / "src" / "lib.rs").write_text("pub fn one() -> u32 { 2 }\n")  # same size
    (checkout / "rust" / "src" / "gone.rs").unlink()  # tracked, deleted, not committed
    (checkout / "rust" / "src" / "new.rs").write_text("// untracked, not ignored\n")
    (checkout / "rust" / "ext.so").write_bytes(b"ignored")
    assert sync_tree.sync(checkout, mirror) == (2, 2)

    assert mtime(mirror / "csrc" / "k.cu") == OLD and mtime(mirror / ".gitignore") == OLD
    assert (mirror / "rust" / "src" / "lib.rs").read_text() == "pub fn one() -> u32 { 2 }\n"
    assert mtime(mirror / "rust" / "src" / "lib.rs") > OLD
    assert (mirror / "rust" / "src" / "new.rs").is_file()
    assert not (mirror / "rust" / "src" / "gone.rs").exists()
    assert not (mirror / "rust" / "ext.so").exists() and not (mirror / "stray").exists()
    assert sync_tree.sync(checkout, mirror) == (0, 0)


def test_a_file_that_became_a_directory_and_a_retargeted_symlink(tmp_path: Path) -> None:
    sync_tree = load_sync_tree()
    checkout, mirror = make_checkout(tmp_path), tmp_path / "mirror"
    sync_tree.sync(checkout, mirror)
    (checkout / "csrc" / "k.cu").unlink()
    (checkout / "csrc" / "k.cu").mkdir()
    (checkout / "csrc" / "k.cu" / "inner.cu").write_text("// now a directory\n")
    (checkout / "link").unlink()
    (checkout / "link").symlink_to("rust")
    sync_tree.sync(checkout, mirror)
    assert (mirror / "csrc" / "k.cu" / "inner.cu").read_text() == "// now a directory\n"
    assert os.readlink(mirror / "link") == "rust"
