"""The house rules, checked: the engine imports nothing from the other packages, no
library package imports the benchmarks, modules and functions stay small, no module
imports another's private names, and only the activation cache moves an entry's state."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "server", "trainer", "offload", "bench")
# every Python file of the project, tests and examples included
ALL_SOURCES = sorted(p for folder in (*PACKAGES, "tests", "examples", "docs") for p in (ROOT / folder).rglob("*.py"))
# the activation cache, the one mover of an entry's state
ENTRY_STATE_OWNERS = {ROOT / "trainer" / "cache.py"}


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


@pytest.mark.parametrize("path", ALL_SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_another_modules_private_names(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            private = [alias.name for alias in node.names if alias.name.startswith("_")]
            assert not private, f"{path}:{node.lineno} imports {private} from {node.module}"


@pytest.mark.parametrize("path", [p for p in ALL_SOURCES if p not in ENTRY_STATE_OWNERS],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_only_the_activation_cache_moves_an_entrys_state(path):
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            assert not (isinstance(target, ast.Attribute) and target.attr == "state"
                        and not (isinstance(target.value, ast.Name) and target.value.id == "app")), \
                f"{path}:{node.lineno} assigns an entry's state: use the cache's methods (trainer/cache.py)"
