"""Plug-ins by name: a user's generator class, advantage estimator, loss, step
hook or reward, given as `module:attribute` (CLI and config.json) or as the
object itself (Python), which the config turns into that name.

Executors run in processes of their own (forked from a fresh server process,
or torchrun ranks on other hosts) and import a plug-in by its name: an object
is taken only if its name imports back to the very same object. A function or
class of the script that starts the run (`__main__`) is found again because
multiprocessing runs that script once more in each executor, as
`__mp_main__`: which is why the code that starts a run must sit under
`if __name__ == "__main__":` (check_main_guard says so before anything starts).
"""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import inspect
import sys
from collections.abc import Mapping
from pathlib import Path


def resolve(spec: str, what: str):
    """The object `spec` ("module:attribute", the attribute possibly dotted)
    names; ValueError naming `what` and the spec when it does not import."""
    module_name, colon, attribute = spec.partition(":")
    if not (colon and module_name and attribute):
        raise ValueError(f"{what} {spec!r}: give module:attribute (e.g. mypkg.rl:my_function)")
    try:
        obj = importlib.import_module(module_name)
        for part in attribute.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{what} {spec!r}: cannot load it: {type(exc).__name__}: {exc}") from None
    return obj


def spec_of(obj, what: str) -> str:
    """`obj`'s importable name, "module:qualified.name"; a string is returned as it
    is. ValueError naming `what` for an object that an executor could not import
    by name: a lambda, a function defined inside another, an instance, an object
    of an interactive session's `__main__`."""
    if isinstance(obj, str):
        return obj
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if module is None or qualname is None:
        raise ValueError(f"{what}: {obj!r} is a {type(obj).__name__} instance; give a function or class defined at "
                         "the top level of a module (executors import it by name)")
    if "<" in qualname:  # <lambda>, <locals>
        raise ValueError(f"{what}: {module}.{qualname} is a lambda or defined inside a function; executors import "
                         "plug-ins by name: define it at the top level of a module")
    if module == "__main__":
        main = sys.modules["__main__"]
        if not getattr(main, "__file__", None) or _runs_a_package(main):
            raise ValueError(f"{what}: {qualname} is defined in __main__ of an interactive session or of `python -m "
                             "package`, which executors do not import again: define it in a module of its own")
        if qualname.split(".")[0] not in _unguarded_names(main.__file__):
            raise ValueError(f"{what}: {qualname} is defined under `if __name__ == \"__main__\":` in "
                             f"{main.__file__}, which executors do not run when they import the script: define it "
                             "above the guard (or in a module of its own)")
    elif importlib.machinery.PathFinder.find_spec(module.split(".")[0], sys.path) is None:
        raise ValueError(f"{what}: {module}.{qualname}: module {module!r} is not importable from sys.path (loaded "
                         "from a file by path?), so executors could not import it: put its folder on the path")
    spec = f"{module}:{qualname}"
    if resolve(spec, what) is not obj:
        raise ValueError(f"{what}: {spec} names another object than the one given (redefined or replaced since)")
    return spec


def load(spec: str, what: str, kind: str):
    """resolve(spec) checked to be a `kind` ("class" or "function": any callable)."""
    obj = resolve(spec, what)
    if kind == "class" and not inspect.isclass(obj):
        raise ValueError(f"{what} {spec!r} is a {type(obj).__name__}, not a class")
    if kind == "function" and not callable(obj):
        raise ValueError(f"{what} {spec!r} is a {type(obj).__name__}, not a function")
    return obj


def builtin_or_load(spec: str, builtins: Mapping, what: str):
    """builtins[spec] for a built-in name, else the function `spec`
    ("module:function") names; ValueError naming `what` for anything else."""
    if spec in builtins:
        return builtins[spec]
    if ":" not in spec:
        raise ValueError(f"{what} {spec!r}: not one of {tuple(builtins)}, nor module:function")
    return load(spec, what, "function")


def check_arity(fn, args: tuple, what: str) -> None:
    """ValueError naming `what` unless `fn` can be called with `args` (positional)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without one: the probe call will tell
        return
    try:
        signature.bind(*args)
    except TypeError as exc:
        raise ValueError(f"{what}: {name_of(fn)}{signature} cannot be called with {len(args)} arguments "
                         f"({exc})") from None


def name_of(fn) -> str:
    """module:qualified name of a function or class, for messages."""
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"


def _runs_a_package(main) -> bool:
    """`python -m package` (its __main__.py), which multiprocessing never imports again."""
    name = getattr(getattr(main, "__spec__", None), "name", None) or ""
    return name == "__main__" or name.endswith(".__main__")


def _is_name_check(test: ast.AST) -> bool:
    """`__name__ == "__main__"` (either operand order), or an `and` holding it."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(_is_name_check(value) for value in test.values)
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    operands = [test.left, *test.comparators]
    return (any(isinstance(o, ast.Name) and o.id == "__name__" for o in operands)
            and any(isinstance(o, ast.Constant) and o.value == "__main__" for o in operands))


def _is_main_guard(node: ast.AST) -> bool:
    """`if __name__ == "__main__":`, possibly with more conditions joined by `and`."""
    return isinstance(node, ast.If) and _is_name_check(node.test)


def _unguarded_names(path: str) -> set[str]:
    """Names the top-level code of the script at `path` binds outside
    `if __name__ == "__main__":` (what an executor importing it gets); every name
    when the script cannot be read."""
    try:
        tree = ast.parse(Path(path).read_text(), path)
    except (SyntaxError, UnicodeDecodeError, OSError):
        return set(vars(sys.modules["__main__"]))
    names: set[str] = set()
    todo = [node for node in tree.body if not _is_main_guard(node)]
    while todo:  # top-level statements, into if / try / with / for blocks, not into function or class bodies
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
        elif not isinstance(node, ast.Lambda):
            todo.extend(ast.iter_child_nodes(node))
    return names


def check_main_guard() -> None:
    """ValueError before any executor starts when the run is being started by the
    top-level code of the main script outside `if __name__ == "__main__":`: every
    executor process runs that script again (multiprocessing's forkserver), and
    would start a run of its own there instead of its work (multiprocessing then
    stops it with exit code 1, its reason only on stderr). Looked up on the call
    stack: the main module's top-level frame, its line in the script's syntax tree."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if _runs_a_package(main):
        return  # multiprocessing does not run a package's __main__ again
    frame = inspect.currentframe()
    while frame is not None and not (frame.f_globals is getattr(main, "__dict__", None)
                                     and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if frame is None or path is None or not Path(path).is_file():
        return  # not started from a script's top level (a function, a test, an interactive session)
    line = frame.f_lineno
    try:
        tree = ast.parse(Path(path).read_text(), path)
    except (SyntaxError, UnicodeDecodeError, OSError):
        return
    guarded = any(_is_main_guard(node) and node.body[0].lineno <= line <= node.body[-1].end_lineno
                  for node in ast.walk(tree))
    if not guarded:
        raise ValueError(f"{path}:{line} starts the run from the script's top level: each executor process runs the "
                         "script again (as __mp_main__) and would start a run of its own there; put the code that "
                         "starts the run under `if __name__ == \"__main__\":`")
