"""Names that left a module, still importable from it for one release.

`moved_names(module, moved)` is the module's `__getattr__`: a name of `moved`
({name: (its new module, its name there)}) is imported from its new home with a
DeprecationWarning naming that home, shown once for each place that uses it, as
Python's warning filters do; any other name is an AttributeError."""

from __future__ import annotations

import importlib
import warnings


def moved_names(module: str, moved: dict[str, tuple[str, str]]):
    def __getattr__(name: str):
        if name not in moved:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        home, new = moved[name]
        warnings.warn(f"{module}.{name} is now {home}.{new}; the old name goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(home), new)

    return __getattr__
