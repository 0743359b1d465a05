"""Records with many fields are built by keyword: a field inserted in the middle must not shift the
values of the fields after it (EngineStats once took the engine's clock as a heap-trim count that way)."""
import dataclasses
import importlib
import inspect
import pkgutil

import servewise

OPTIONAL = {"ray", "triton"}  # extras: modules that need them are skipped where they are not installed


def _modules():
    for info in pkgutil.walk_packages(servewise.__path__, "servewise."):
        if info.name.endswith("__main__"):  # runs the command line
            continue
        try:
            yield importlib.import_module(info.name)
        except ModuleNotFoundError as e:
            if e.name.split(".")[0] not in OPTIONAL:
                raise


def test_dataclasses_with_more_than_six_fields_take_at_most_four_by_position():
    seen, wide = set(), []
    for mod in _modules():
        for _, cls in inspect.getmembers(mod, inspect.isclass):
            if cls in seen or not dataclasses.is_dataclass(cls) or not cls.__module__.startswith("servewise"):
                continue
            seen.add(cls)
            init = [f for f in dataclasses.fields(cls) if f.init]
            positional = [f.name for f in init if not f.kw_only]
            if len(init) > 6 and len(positional) > 4:
                wide.append(f"{cls.__module__}.{cls.__qualname__}: {', '.join(positional)}")
    assert len(seen) > 40  # the walk found the package's records
    assert not wide, "make these kw_only (or put a KW_ONLY marker after their leading fields):\n" + "\n".join(wide)
