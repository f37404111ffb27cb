"""The package's layering, read off its source: no import circle among its
modules, each package importing only the ones beneath it, `check` and `bench`
reached only from the CLI, the pipeline and the models using only the sync's public
modules, and every package shipped by pyproject.toml."""

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "llamarl_core"

# What each package of llamarl_core may import at module level (besides itself and
# the top-level helper modules of ALWAYS). Beneath everything: control (the
# control plane), ops (kernels) and the planner (plain arithmetic); sync builds on
# control and ops; models on sync; the pipeline and the integrations on all of those.
ALWAYS = {"llamarl_core", "llamarl_core._moved", "llamarl_core._native", "llamarl_core.spelling"}
MAY_IMPORT = {
    "control": set(),
    "ops": set(),
    "planner": set(),
    "sync": {"control", "ops", "models.llama_family"},
    "models": {"control", "ops", "sync"},
    "pipeline": {"control", "ops", "sync", "models", "forkserver", "planner"},
    "integrations": {"control", "ops", "sync", "models", "pipeline", "forkserver"},
}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(name: str, path: Path, module_level: bool, source: str | None = None) -> set[str]:
    """The llamarl_core modules `name` (at `path`, or `source`) imports (module
    level only, or anywhere), with the packages each import runs on the way
    (importing a.b.c runs a and a.b), except `name`'s own parents (run before it)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if module_level and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue
            if isinstance(child, ast.Import):
                targets = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - (child.level - 1)]
                    module = ".".join(base + ([child.module] if child.module else []))
                else:
                    module = child.module or ""
                targets = [module] + [f"{module}.{alias.name}" for alias in child.names]
            else:
                visit(child)
                continue
            for target in targets:
                parts = target.split(".")
                for i in range(1, len(parts) + 1):
                    prefix = ".".join(parts[:i])
                    if prefix in MODULES and not name.startswith(prefix + ".") and prefix != name:
                        found.add(prefix)

    visit(ast.parse(path.read_text() if source is None else source, str(path)))
    return found


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every circle a depth-first walk of `graph` meets (none iff it has none)."""
    circles, state = [], {}

    def walk(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                circles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                walk(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            walk(node, [])
    return circles


def test_no_import_circle_among_the_modules():
    circles = _circles({name: _imports(name, path, module_level=True) for name, path in MODULES.items()})
    assert not circles, "\n".join(" -> ".join(c) for c in circles)


def test_each_package_imports_only_the_ones_beneath_it():
    wrong = []
    for name, path in MODULES.items():
        own = _package(name)
        if own not in MAY_IMPORT:
            continue
        for target in _imports(name, path, module_level=True) - ALWAYS:
            rest = target.removeprefix("llamarl_core.")
            # An allowed module's parent packages run too (sync -> models.llama_family runs models/__init__.py).
            parents = {a.rsplit(".", i)[0] for a in MAY_IMPORT[own] for i in range(1, a.count(".") + 1)}
            if _package(target) == own or rest in parents or any(
                    rest == a or rest.startswith(a + ".") for a in MAY_IMPORT[own]):
                continue
            wrong.append(f"{name} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_the_pipeline_and_the_models_use_only_the_syncs_public_modules():
    from llamarl_core.sync import PUBLIC_MODULES

    public = {"llamarl_core.sync"} | {f"llamarl_core.sync.{m}" for m in PUBLIC_MODULES}
    reach = sorted(f"{name} imports {target}" for name, path in MODULES.items()
                   if _package(name) in ("pipeline", "models", "check", "control", "ops", "integrations")
                   for target in _imports(name, path, module_level=False)
                   if _package(target) == "sync" and target not in public)
    assert not reach, "\n".join(reach)


def test_check_and_bench_are_reached_only_from_the_cli():
    reach = {name for name, path in MODULES.items() if _package(name) not in ("check", "bench", "cli")
             for target in _imports(name, path, module_level=False) if _package(target) in ("check", "bench")}
    assert not reach, reach


def test_pyproject_ships_every_package():
    shipped = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {name for name, path in MODULES.items() if path.name == "__init__.py"}
    assert packages <= shipped, packages - shipped


def test_the_checks_see_a_circle_and_an_import_from_above():
    """The walk finds what it looks for: a circle in a small graph; a module of
    `control` importing the pipeline (its TYPE_CHECKING and in-function imports
    aside); the parents an import runs."""
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert _circles({"a": {"b"}, "b": {"c"}, "d": {"a", "c"}}) == []
    probe = PACKAGE / "control" / "probe.py"
    source = ("from typing import TYPE_CHECKING\nfrom ..pipeline import config\nif TYPE_CHECKING:\n"
              "    from ..sync import plan\ndef f():\n    from ..models import llama_family\n")
    assert _imports("llamarl_core.control.probe", probe, True, source) == {
        "llamarl_core.pipeline", "llamarl_core.pipeline.config"}
    assert _imports("llamarl_core.control.probe", probe, False, source) == {
        "llamarl_core.pipeline", "llamarl_core.pipeline.config", "llamarl_core.models",
        "llamarl_core.models.llama_family"}
