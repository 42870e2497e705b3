"""The package's layering, checked on the source: which modules may import which, and one class per name.

Layers, bottom up: `protocol` (the wire types; imports nothing from voltllm) -> `ops`, `layers`, `models`,
`loader` (the model side) and `core`, `worker` (the scheduler and the runner) -> `engine` (EngineCore, its
process, the in-process engine) -> `entrypoints` (CLI, offline `LLM`, `serve`). A lower layer never
imports a higher one, not even lazily inside a function. Models reach kernels only through layers (the
attention backend, the linear and norm layers), never `voltllm.ops` directly.

Every import statement is read with `ast`, wherever it sits (module level, functions, `TYPE_CHECKING`
blocks), relative imports resolved, and so are `importlib.import_module("...")` calls with a literal name.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "python" / "voltllm"
LOWER_LAYERS = ("core", "worker", "models", "layers", "ops", "loader", "structured_output")
HIGHER_LAYERS = ("voltllm.engine", "voltllm.entrypoints")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(*subpackages: str) -> list[Path]:
    """Every .py file under the given subpackages of voltllm (all of it when none is given)."""
    roots = [PACKAGE_DIR / s for s in subpackages] if subpackages else [PACKAGE_DIR]
    return sorted(p for root in roots for p in root.rglob("*.py"))


def imported_names(path: Path) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in a file."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    return imported_names_in(path.read_text(encoding="utf-8"), package)


def imported_names_in(source: str, package: str) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in `source`, a module of `package`. `from a import
    b` yields `a.b` as well as `a`, so `from voltllm import engine` counts as importing `voltllm.engine`."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__"))
            )
        ):
            yield node.lineno, node.args[0].value


def is_within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def violations(paths: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for path in paths:
        for line, name in imported_names(path):
            if any(is_within(name, f) for f in forbidden):
                found.append(f"{path.relative_to(PACKAGE_DIR.parent)}:{line} imports {name}")
    return sorted(set(found))


def test_the_package_is_where_the_test_looks() -> None:
    assert (PACKAGE_DIR / "__init__.py").is_file()
    for sub in LOWER_LAYERS:
        assert modules(sub), f"no modules under voltllm/{sub}"


@pytest.mark.parametrize("layer", LOWER_LAYERS)
def test_lower_layers_never_import_the_engine_or_the_entrypoints(layer: str) -> None:
    assert violations(modules(layer), HIGHER_LAYERS) == []


def test_models_reach_kernels_only_through_layers() -> None:
    assert violations(modules("models"), ("voltllm.ops",)) == []


def test_structured_output_sits_on_the_foundation() -> None:
    """The grammar matchers are shared by the scheduler (`core`) and the runner (`worker`), so the
    package imports neither, nor the model side: only the wire types."""
    assert (
        violations(modules("structured_output"), ("voltllm.core", "voltllm.worker", "voltllm.models")) == []
    )


def test_the_engine_never_imports_the_entrypoints() -> None:
    assert violations(modules("engine"), ("voltllm.entrypoints",)) == []


def test_the_wire_protocol_is_a_foundation_module() -> None:
    """`voltllm.protocol` is imported by every layer, so it imports none of them."""
    names = [name for _, name in imported_names(PACKAGE_DIR / "protocol.py")]
    assert [n for n in names if is_within(n, "voltllm")] == []


def test_the_wire_types_live_only_in_voltllm_protocol() -> None:
    assert not (PACKAGE_DIR / "engine" / "protocol.py").exists()


@pytest.mark.parametrize("class_name", ["SamplingParams", "Logprob"])
def test_one_class_per_name(class_name: str) -> None:
    """The user-facing `SamplingParams` and `Logprob` are the only classes with those names; the wire
    structs beside them are `EngineSamplingParams` and `TokenLogprobs`."""
    defined = [
        f"{path.relative_to(PACKAGE_DIR.parent)}:{node.lineno}"
        for path in modules()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ClassDef) and node.name == class_name
    ]
    assert len(defined) == 1, f"class {class_name} is defined {len(defined)} times: {defined}"


def test_the_scanner_sees_every_form_of_import() -> None:
    """Plain, from, relative, lazy and importlib imports are all found."""
    source = (
        "import voltllm.engine.core\n"
        "from voltllm import entrypoints\n"
        "from ..engine import args\n"
        "def f():\n"
        "    from voltllm.entrypoints.llm import LLM\n"
        "    importlib.import_module('voltllm.engine.core_proc')\n"
    )
    assert {name for _, name in imported_names_in(source, "voltllm.core")} >= {
        "voltllm.engine.core",
        "voltllm.entrypoints",
        "voltllm.engine.args",
        "voltllm.entrypoints.llm",
        "voltllm.engine.core_proc",
    }
