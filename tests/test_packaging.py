"""What a user meets before any code runs: every relative link of the README and the guides leads to a file
(and heading) that exists, every third-party module the package and its tests import is declared in
pyproject.toml, and matplotlib (the `plot` extra) is optional: experiments without it say so and skip their
figures."""
from __future__ import annotations

import importlib
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

from servewise.experiments import publish

ROOT = Path(__file__).resolve().parent.parent
# imported but deliberately not declared: the module runs only in another project's environment
NOT_DECLARED = {"vllm": "bench offline's worker runs in vLLM's own environment (--vllm-python)"}


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub writes it: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    out, seen, fenced = set(), {}, False
    for line in path.read_text().splitlines():
        fenced ^= line.startswith("```")
        m = None if fenced else re.match(r"#{1,6} (.*)", line)
        if m:
            s = _slug(m.group(1))
            out.add(f"{s}-{seen[s]}" if s in seen else s)
            seen[s] = seen.get(s, 0) + 1
        out.update(re.findall(r'<a (?:id|name)="([^"]+)"', line))  # explicit anchors
    return out


def broken_links(files: list[Path], root: Path = ROOT) -> list[str]:
    bad = []
    for f in files:
        text = re.sub(r"```.*?```", "", f.read_text(), flags=re.S)  # code blocks hold no links
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (f.parent / path).resolve() if path else f
            if not dest.exists():
                bad.append(f"{f.relative_to(root)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{f.relative_to(root)}: {target} (no such heading)")
    return bad


def test_every_relative_link_in_the_readme_and_the_docs_resolves(tmp_path):
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    assert len(docs) > 20
    assert broken_links(docs) == []
    # the check itself finds a missing file and a missing heading
    (tmp_path / "a.md").write_text('# Title\n<a id="here"></a>\n[ok](a.md#title) [ok](#here) [file](b.md) '
                                   "[heading](a.md#nothing)\n")
    assert broken_links([tmp_path / "a.md"], tmp_path) == ["a.md: b.md (no such file)",
                                                           "a.md: a.md#nothing (no such heading)"]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


_NAME = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
# an import statement's line: `from a.b import ...`, or `import a.b [as c][, d [as e]]` alone on its line (so a
# docstring's prose does not match; over this repository it finds the same modules as a walk of every file's
# syntax tree, at a sixtieth of the time)
_IMPORT = re.compile(rf"^([ \t]*)(?:from[ \t]+({_NAME})[ \t]+import\b|import[ \t]+({_NAME}(?:[ \t]+as[ \t]+\w+)?"
                     rf"(?:[ \t]*,[ \t]*{_NAME}(?:[ \t]+as[ \t]+\w+)?)*)[ \t]*(?:#.*)?$)", re.M)


def _imports(path: Path) -> list[tuple[bool, str]]:
    """(at module level, top-level module name) of each absolute import in a file, and of each module a test
    imports through pytest.importorskip."""
    out = []
    text = path.read_text()
    for indent, frm, names in _IMPORT.findall(text):
        mods = [frm] if frm else [n.split()[0] for n in names.split(",")]
        out += [(not indent, m.strip().split(".")[0]) for m in mods]
    return out + [(False, m) for m in re.findall(r'importorskip\(\s*"([\w.]+)"', text)]  # a test's optional modules


def _imported_modules() -> set[str]:
    local = {p.stem for p in (ROOT / "tests").glob("*.py")} | {"servewise"}
    mods = {m for path in [*(ROOT / "servewise").rglob("*.py"), *(ROOT / "tests").glob("*.py")]
            for _, m in _imports(path)}
    return {m for m in mods if m not in sys.stdlib_module_names and m not in local}


def test_every_third_party_import_is_declared_in_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    declared = {_norm(re.match(r"[A-Za-z0-9_.\-]+", r).group()) for r in requirements}
    dists = importlib.metadata.packages_distributions()
    undeclared = []
    for mod in sorted(_imported_modules()):
        if mod in NOT_DECLARED:
            continue
        names = {_norm(d) for d in dists.get(mod, [])}
        if not names & declared:
            undeclared.append(f"{mod} (distribution {sorted(names) or 'not installed'})")
    assert undeclared == []
    assert "matplotlib" not in {_norm(re.match(r"[A-Za-z0-9_.\-]+", r).group()) for r in project["dependencies"]}


def test_matplotlib_is_imported_only_inside_the_functions_that_plot():
    plots = [path for path in (ROOT / "servewise").rglob("*.py") if any(m == "matplotlib" for _, m in _imports(path))]
    assert len(plots) >= 5  # the experiments' and benchmarks' plotting modules
    for path in (ROOT / "servewise").rglob("*.py"):
        assert (True, "matplotlib") not in _imports(path), f"{path} imports matplotlib at module level"


def test_an_experiment_without_matplotlib_says_so_and_keeps_its_report(tmp_path, monkeypatch, capsys):
    def plot(res, out_dir):
        importlib.import_module("matplotlib")  # fails without it, as the experiments' plots do

        (tmp_path / "fig.png").write_text("")
        return [str(tmp_path / "fig.png")]

    publish({"x": 1}, "the report", str(tmp_path), "run", plot)
    assert "figure: " in capsys.readouterr().out and (tmp_path / "fig.png").exists()
    (tmp_path / "fig.png").unlink()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed: importing it fails
    publish({"x": 1}, "the report", str(tmp_path), "run", plot)
    out = capsys.readouterr().out
    assert "figures skipped: matplotlib is not installed" in out and "figure: " not in out
    assert (tmp_path / "run.txt").read_text() == "the report\n" and (tmp_path / "run.json").exists()
    assert not (tmp_path / "fig.png").exists()


def test_every_data_file_the_package_reads_is_package_data():
    """A wheel carries only the Python and the package-data globs: the kernels' C++ sources and headers (built on
    first use) and the shipped calibration must be among them, or a non-editable install loses them silently."""
    from fnmatch import fnmatch

    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["servewise"]
    pkg = ROOT / "servewise"
    data = [p.relative_to(pkg).as_posix() for p in pkg.rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts]
    assert data, "no data files found"
    assert [d for d in data if not any(fnmatch(d, g) for g in globs)] == []
