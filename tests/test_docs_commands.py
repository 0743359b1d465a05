"""Every `servewise ...` command in the README and the guides parses with today's command line, by the current
names (no deprecated alias). The commands are parsed, never run. Notes (docs/notes/) record what was run then,
with the names of then, and are not checked."""
import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from servewise.cli import parser
from servewise.commands.options import _Alias

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")  # DATA, MODEL_DIR, FILE, L, ... (whole words only)
# Commands a guide shows that need more than this package: (file, command) -> why
NEEDS_MORE = {("docs/arena.md", "servewise simulate --policy longest-prompt-first"):
              "a policy the guide's example installs as an entry point"}


def commands_in(text: str) -> list[str]:
    """`servewise ...` command lines of a markdown text: code blocks' lines (with their `\\` continuations) and
    inline code spans (which may wrap over lines)."""
    found, prose, in_block, block = [], [], False, []
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if in_block:
                joined = "\n".join(block).replace("\\\n", " ")
                for cmd in joined.splitlines():
                    cmd = " ".join(re.sub(r"\s#.*$", "", cmd.strip().removeprefix("$ ")).split())
                    if cmd.startswith("servewise "):
                        found.append(cmd)
                block = []
            in_block = not in_block
            continue
        (block if in_block else prose).append(line)
    for span in re.findall(r"`([^`]+)`", "\n".join(prose)):
        span = " ".join(span.split())
        if span.startswith("servewise "):
            found.append(span)
    return found


def all_commands() -> list[tuple[str, str]]:
    return [(f.relative_to(ROOT).as_posix(), c) for f in DOCS for c in commands_in(f.read_text())]


def mentions_in(text: str) -> list[str]:
    """Inline code spans outside code blocks that name a command without `servewise` and give some of its options
    (`cluster --perf-table`, `predict-lengths --num-prompts 600 --save`): not whole commands, but their names count."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    spans = (" ".join(s.split()) for s in re.findall(r"`([^`]+)`", prose))
    return [s for s in spans if re.match(r"[a-z][a-z-]*( [a-z][a-z-]*)? --[a-z]", s)]


def unknown_or_old_options(p, mention: str) -> list[str]:
    """The options of a mention its command does not have, or has only as a deprecated name; [] also where the
    first words name no command (prose that merely looks like one)."""
    words = mention.split()
    while words and not words[0].startswith("-"):
        sub = next((a for a in p._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or words[0] not in sub.choices:
            return []
        p = sub.choices[words.pop(0)]
    known = p._option_string_actions
    return [w for w in words if w.startswith("--") and (w not in known or isinstance(known[w], _Alias))]


def parse_quietly(p, cmd: str) -> tuple[int, str]:
    """(exit code, stderr): 0 where it parsed; stderr holds argparse's error or the deprecation lines. Optional
    parts in brackets (`[--full]`) are parsed too; a trailing `&` is dropped; a mention without options
    (`servewise experiment NAME`) is checked as `servewise experiment --help`: the command exists."""
    argv = shlex.split(cmd.replace("[", " ").replace("]", " ").removesuffix("&"))[1:]
    if not any(a.startswith("-") for a in argv):
        argv = [a for a in argv if not PLACEHOLDER.match(a)] + ["--help"]
    argv = ["1" if PLACEHOLDER.match(a) else a for a in argv]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            p.parse_args(argv)
        except SystemExit as e:
            return int(e.code or 0), err.getvalue()
    return 0, err.getvalue()


def test_extraction_finds_code_blocks_continuations_and_inline_commands():
    text = ("Run `servewise simulate --num-prompts 5` or\n`servewise bench serve\n--request-rate 8`.\n\n"
            "```bash\nservewise cluster --prompt-machines dgx-a100:2 \\\n    --token-machines dgx-a100:1  # two\n"
            "pip install servewise\n```\n")
    assert commands_in(text) == [
        "servewise cluster --prompt-machines dgx-a100:2 --token-machines dgx-a100:1",
        "servewise simulate --num-prompts 5", "servewise bench serve --request-rate 8"]


def test_parse_quietly_tells_unknown_and_deprecated_names():
    p = parser()
    assert parse_quietly(p, "servewise simulate --num-prompts 5") == (0, "")
    assert parse_quietly(p, "servewise experiment NAME")[0] == 0
    assert parse_quietly(p, "servewise no-such-command")[0] == 2
    assert parse_quietly(p, "servewise simulate [--no-such-flag]")[0] == 2
    code, err = parse_quietly(p, "servewise simulate --no-such-flag 5")
    assert code == 2 and "unrecognized" in err
    code, err = parse_quietly(p, "servewise simulate --num-requests 5")
    assert code == 0 and "is deprecated" in err
    code, err = parse_quietly(p, "servewise simulate --workload shared_prefix")
    assert code == 0 and "is deprecated" in err


def test_docs_commands_parse_by_current_names():
    p = parser()
    cmds = all_commands()
    assert len(cmds) > 100, "the extraction lost the docs' commands"
    incomplete, bad = [], []
    for where, cmd in cmds:
        if "..." in cmd or (where, cmd) in NEEDS_MORE:  # an excerpt, not a whole command
            incomplete.append(cmd)
            continue
        code, err = parse_quietly(p, cmd)
        if code != 0 or "deprecated" in err:
            bad.append(f"{where}: {cmd}\n    -> {err.strip().splitlines()[-1] if err.strip() else code}")
    assert not bad, "\n".join(bad)
    assert len(incomplete) < len(cmds) / 4, f"{len(incomplete)} of {len(cmds)} commands are excerpts"


def test_docs_option_mentions_use_current_names():
    p = parser()
    assert unknown_or_old_options(p, "cluster --prompt dgx-a100:2 --perf-table") == ["--prompt"]
    assert unknown_or_old_options(p, "predict-lengths --no-such --num-prompts 600") == ["--no-such"]
    assert unknown_or_old_options(p, "not-a-command --prompt") == []
    mentions = [(f.relative_to(ROOT).as_posix(), m) for f in DOCS for m in mentions_in(f.read_text())]
    assert len(mentions) > 10, "the extraction lost the docs' mentions"
    bad = [f"{where}: {m}: {unknown_or_old_options(p, m)}" for where, m in mentions if unknown_or_old_options(p, m)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("old", ["--num-requests", "--rate", "--chunked-prefill"])
def test_an_old_name_in_a_guide_is_caught(old):
    p = parser()
    code, err = parse_quietly(p, f"servewise simulate {old}" + ("" if old == "--chunked-prefill" else " 4"))
    assert code == 0 and "deprecated" in err
