"""The kernel cache's key and lookup (`voltllm.ops.build`, CPU): the key follows the sources' bytes and the
build flags, not their mtimes, and a library found under its key is loaded without a build, so one built
ahead of time elsewhere can be carried in (`VOLTLLM_KERNEL_CACHE`)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from voltllm.ops import build


@pytest.fixture
def sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private copy of the kernel sources, made the build's include root."""
    copy = tmp_path / "csrc"
    shutil.copytree(build.CSRC_DIR, copy)
    monkeypatch.setattr(build, "CSRC_DIR", copy)
    monkeypatch.setattr(build, "_loaded_arch", None)
    monkeypatch.setenv("VOLTLLM_KERNEL_CACHE", str(tmp_path / "cache"))
    return copy


def test_the_key_follows_the_sources_bytes_not_their_mtimes(sources: Path) -> None:
    before = build.cache_dir("9.0")
    header = sources / "common.cuh"
    os.utime(header, (1, 1))  # older than any build: ninja would not look at it again
    assert build.cache_dir("9.0") == before
    header.write_text(header.read_text() + "\n// one more line\n")
    os.utime(header, (1, 1))
    assert build.cache_dir("9.0") != before


def test_the_key_ignores_files_the_build_does_not_read(sources: Path) -> None:
    before = build.cache_dir("9.0")
    (sources / "README.md").write_text("other words\n")
    assert build.cache_dir("9.0") == before


def test_the_key_names_torch_cuda_and_the_architecture(sources: Path, tmp_path: Path) -> None:
    sm70, sm90 = build.cache_dir("7.0"), build.cache_dir("9.0")
    assert sm70 != sm90 and sm70.parent == sm90.parent == tmp_path / "cache"
    assert sm90.name.startswith(f"torch{torch.__version__.split('+')[0]}-cu")
    assert "-sm90-" in sm90.name and build.source_digest()[:16] in sm90.name


def test_the_key_follows_the_build_flags(sources: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = build.cache_dir("9.0")
    monkeypatch.setattr(build, "CUDA_CFLAGS", (*build.CUDA_CFLAGS, "-G"))
    assert build.cache_dir("9.0") != before


def _no_cuda_torch() -> bool:
    return torch.version.cuda is None


@pytest.mark.skipif(_no_cuda_torch(), reason="load() refuses a torch without CUDA before the cache")
def test_a_cached_library_is_loaded_without_building(sources: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    library = build.cache_dir("9.0") / f"{build.library_name('9.0')}.so"
    library.parent.mkdir(parents=True)
    library.write_bytes(b"carried")
    loaded: list[str] = []
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)

    def no_build(*args: object) -> None:
        raise AssertionError("built although the cache holds the library")

    monkeypatch.setattr(build, "_build", no_build)
    assert build.load("9.0") == "9.0"
    assert loaded == [str(library)]


@pytest.mark.skipif(_no_cuda_torch(), reason="load() refuses a torch without CUDA before the cache")
def test_a_library_that_does_not_load_is_built_again(sources: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    library = build.cache_dir("9.0") / f"{build.library_name('9.0')}.so"
    library.parent.mkdir(parents=True)
    library.write_bytes(b"cut short")  # not an ELF file: dlopen refuses it
    built: list[tuple[str, Path]] = []
    monkeypatch.setattr(build, "_build", lambda arch, where, verbose: built.append((arch, where)))
    assert build.load("9.0") == "9.0"
    assert built == [("9.0", library.parent)]
