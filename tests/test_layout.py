"""The house rules, checked: the engine imports nothing from the other packages, no
library package imports the benchmarks, and modules and functions stay small."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "server", "trainer", "offload", "bench")


def modules(package: str):
    return sorted((ROOT / package).glob("*.py"))


def imported_packages(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("path", modules("engine"), ids=lambda p: p.name)
def test_engine_imports_nothing_from_the_other_packages(path):
    assert not imported_packages(path) & {"trainer", "server", "offload", "bench"}


@pytest.mark.parametrize("path", [p for pkg in ("engine", "trainer", "offload") for p in modules(pkg)],
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_library_packages_hold_no_benchmark_and_import_no_server(path):
    assert not imported_packages(path) & {"bench", "server"}
    assert not path.name.startswith("bench")


@pytest.mark.parametrize("path", [p for pkg in PACKAGES for p in modules(pkg)],
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_modules_and_functions_stay_small(path):
    text = path.read_text()
    assert text.count("\n") <= 400, f"{path} has {text.count(chr(10))} lines"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert node.end_lineno - node.lineno + 1 <= 80, f"{path}:{node.lineno} {node.name}"
