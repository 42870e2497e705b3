"""The kernel sources the package builds from (CPU): present, complete and laid out as csrc/README.md says.

Under tools/test.sh `voltllm` is the installed wheel, so this is also the check that the wheel carries
every source `voltllm.ops.build` compiles and every header those include (`voltllm/_csrc/`).
"""

from __future__ import annotations

import re
from pathlib import Path

from voltllm.ops import build, variants

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
TORCH_HEADERS = re.compile(r"^\s*#\s*include\s+[<\"](torch|ATen|c10|pybind11)/", re.M)


def _sources() -> dict[str, str]:
    root = build.CSRC_DIR
    return {
        str(p.relative_to(root)): p.read_text()
        for p in sorted(root.rglob("*"))
        if p.suffix in (".cuh", ".cu", ".h", ".cpp")
    }


def test_the_package_carries_what_the_build_compiles() -> None:
    sources = _sources()
    assert set(build.SOURCES) <= set(sources), build.CSRC_DIR
    assert set(variants.sm90_variants()) <= set(sources)  # every kernel source the gate checks


def test_every_include_resolves_from_the_include_root() -> None:
    """Quoted includes name a path from csrc/ (the one include root), and that file is shipped."""
    sources = _sources()
    for name, text in sources.items():
        for included in INCLUDE.findall(text):
            assert included in sources, f"{name} includes {included!r}, which is not under csrc/"


def test_kernels_are_torch_free_and_grouped_by_job() -> None:
    """Only csrc/torch_glue/ sees torch; kernels live in a folder per job, beside common.cuh."""
    jobs = ("attention", "ops", "sampling", "structured", "moe", "quantization")
    for name, text in _sources().items():
        top = Path(name).parts[0]
        assert top in (*jobs, "torch_glue", "common.cuh"), name
        if top != "torch_glue":
            assert not TORCH_HEADERS.search(text), f"{name} includes a torch header"
            assert not any(Path(i).parts[0] == "torch_glue" for i in INCLUDE.findall(text)), name
