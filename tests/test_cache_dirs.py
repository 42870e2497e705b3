"""One cache root for everything voltllm keeps (`voltllm.cache_dirs`): imported models and built kernels
live under the same root, chosen by `$VOLTLLM_CACHE_DIR`, else `$XDG_CACHE_HOME`, else the home folder;
`$VOLTLLM_KERNEL_CACHE` moves the kernels alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from voltllm.cache_dirs import kernels_cache_dir, models_cache_dir, voltllm_cache_dir


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    for name in ("VOLTLLM_CACHE_DIR", "XDG_CACHE_HOME", "VOLTLLM_KERNEL_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return monkeypatch


def test_the_root_is_the_home_cache_by_default(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    root = tmp_path / "home" / ".cache" / "voltllm"
    assert voltllm_cache_dir() == root
    assert models_cache_dir() == root / "models"
    assert kernels_cache_dir() == root / "kernels"


def test_xdg_cache_home_moves_models_and_kernels(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models_cache_dir() == tmp_path / "xdg" / "voltllm" / "models"
    assert kernels_cache_dir() == tmp_path / "xdg" / "voltllm" / "kernels"


def test_voltllm_cache_dir_wins_over_xdg(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    clean_env.setenv("VOLTLLM_CACHE_DIR", str(tmp_path / "mine"))
    assert models_cache_dir() == tmp_path / "mine" / "models"
    assert kernels_cache_dir() == tmp_path / "mine" / "kernels"


def test_the_kernel_cache_alone_can_be_moved(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env.setenv("VOLTLLM_CACHE_DIR", str(tmp_path / "mine"))
    clean_env.setenv("VOLTLLM_KERNEL_CACHE", str(tmp_path / "carried"))
    assert kernels_cache_dir() == tmp_path / "carried"
    assert models_cache_dir() == tmp_path / "mine" / "models"
