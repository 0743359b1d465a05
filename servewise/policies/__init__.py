"""Pluggable scheduling policies, each registered by name in a plain dict. Every module of this package
is imported with it, so a new file here that registers an ordering (ordering.register) is selectable by
name (--policy) on the real engine and in the simulator with no change elsewhere."""
import importlib
import pkgutil

from servewise.policies.ordering import ADMISSION_RULES, ORDERING_POLICIES, register
from servewise.policies.preemption import PREEMPTION_POLICIES, SYSTEMS

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["ADMISSION_RULES", "ORDERING_POLICIES", "PREEMPTION_POLICIES", "SYSTEMS", "register"]
