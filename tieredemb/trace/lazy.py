"""Package attributes imported on first use (PEP 562), so that importing a package costs nothing
until one of its names is used: `import tieredemb.trace` or `tieredemb.sim` loads neither numba
nor torch. Contract: a public name must not also be a submodule's name (the import system would
set the submodule as the package's attribute over it)."""

from __future__ import annotations

import importlib.util
from importlib import import_module


def submodule(package: str, name: str):
    """package.name imported, where it is a submodule (as `package.name.f` reads after a plain
    `import package`), else AttributeError."""
    if not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
        return import_module(f"{package}.{name}")  # (the import makes it the package's attribute)
    raise AttributeError(f"module {package!r} has no attribute {name!r}")


def lazy_exports(package: str, exports: dict[str, str]):
    """(__getattr__, __dir__) for `package`: exports maps each public name to the module that
    defines it (relative to the package, like ".format", or absolute). Submodules are imported on
    first use as well."""
    namespace = import_module(package).__dict__

    def __getattr__(name: str):
        where = exports.get(name)
        if where is None:
            return submodule(package, name)
        value = getattr(import_module(where, package), name)
        namespace[name] = value  # later lookups skip this function
        return value

    def __dir__():
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
