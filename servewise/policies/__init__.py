"""Pluggable scheduling policies, each registered by name in a plain dict. Every module of this package
is imported with it, so a new file here that registers an ordering (ordering.register) is selectable by
name (--policy) on the real engine and in the simulator with no change elsewhere. A policy from outside
the package is named by its file (`PATH.py` or `PATH.py:NAME`) or by an installed entry point of the
group `servewise.policies` (`resolve`)."""
import importlib
import importlib.util
import os
import pkgutil
from importlib.metadata import entry_points

from servewise.policies.ordering import ADMISSION_RULES, ORDERING_POLICIES, register
from servewise.policies.preemption import PREEMPTION_POLICIES, SYSTEMS

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

GROUP = "servewise.policies"
_files: dict[str, list[str]] = {}  # policy files loaded: path -> the names it registered


def resolve(name: str) -> str:
    """The registered name of an ordering policy, loading it first when it lives outside the package:
    `PATH.py` or `PATH.py:NAME` (a Python file whose import registers it), or the name of an entry point
    of the group `servewise.policies` (a module of an installed package that registers it). Unknown
    names raise ValueError."""
    if name in ORDERING_POLICIES:
        return name
    path, dot_py, wanted = name.partition(".py")
    if dot_py and (not wanted or wanted.startswith(":")):
        return _from_file(path + dot_py, wanted[1:] or None)
    for ep in entry_points(group=GROUP):
        if ep.name == name:
            ep.load()
            if name not in ORDERING_POLICIES:
                raise ValueError(f"the entry point {name!r} ({ep.value}) registers no ordering policy of that name")
            return name
    raise ValueError(f"unknown ordering policy {name!r}; choose from {', '.join(ORDERING_POLICIES)}, a file "
                     f"(PATH.py or PATH.py:NAME) or an installed entry point of the group {GROUP}")


def _from_file(path: str, wanted: str | None) -> str:
    if not os.path.isfile(path):
        raise ValueError(f"policy file {path}: no such file")
    key = os.path.realpath(path)
    if key not in _files:  # import it once
        before = set(ORDERING_POLICIES)
        spec = importlib.util.spec_from_file_location(f"servewise_policy_{len(_files)}", path)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        _files[key] = [n for n in ORDERING_POLICIES if n not in before]
    new = _files[key]
    if wanted is not None:
        if wanted not in new:
            raise ValueError(f"policy file {path} registers no policy {wanted!r} (it registers: {', '.join(new)})")
        return wanted
    if len(new) != 1:
        raise ValueError(f"policy file {path} registers {len(new)} policies ({', '.join(new) or 'none'}); "
                         f"name one: {path}:NAME")
    return new[0]


__all__ = ["ADMISSION_RULES", "ORDERING_POLICIES", "PREEMPTION_POLICIES", "SYSTEMS", "register", "resolve"]
