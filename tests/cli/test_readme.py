"""The README cannot drift from the CLI: every `minirun ...` line in its code blocks parses (the
command exists, each flag is one of its options, each value converts), and every `--hca-opt` key
its options table names is one the CLI takes."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

from minirun.cli.main import cli
from minirun.cli.common import ADVANCED

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def command_lines() -> list[str]:
    """The `minirun ...` lines of the README's code blocks, comments cut, continuations joined."""
    lines = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", README, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line.startswith("minirun "):
                lines.append(line)
    return lines


def test_readme_has_commands():
    cmds = {line.split()[1] for line in command_lines()}
    assert {"pull", "chat", "generate", "serve", "bench", "plan", "calibrate", "eval", "convert"} <= cmds


@pytest.mark.parametrize("line", command_lines())
def test_readme_command_parses(line):
    name, *args = shlex.split(line)[1:]
    cmd = cli.commands.get(name)
    assert cmd is not None, f"README: `{line}`: no command {name}"
    try:
        cmd.make_context(name, args)
    except click.UsageError as e:
        pytest.fail(f"README: `{line}`: {e.format_message()}")


def test_readme_flags_and_hca_opts_exist():
    """Every flag in the options section is an option of chat (or, in its server paragraph, of
    serve); every --hca-opt key is a real one."""
    names = {o for name in ("chat", "serve") for p in cli.commands[name].params
             for o in getattr(p, "opts", []) + getattr(p, "secondary_opts", [])}
    table = README[README.index("## Options"):README.index("## Performance")]
    flags = set(re.findall(r"`(--[a-z-]+)", table))
    assert flags and flags <= names, flags - names
    keys = set(re.findall(r"^\| `([a-z_]+)`", table, re.M)) | set(re.findall(r"`([a-z_]+)`,", table))
    keys = {k for k in keys if "_" in k or k in ADVANCED}
    assert {"far_positions", "rescore", "value_sum", "cuda_graphs"} <= keys and keys <= set(ADVANCED), keys - set(ADVANCED)


def test_results_tables_match_their_files():
    """Every results table in README.md and docs/*.md is what scripts/results_tables.py renders from
    docs/results/ (a figure edited by hand, or a results file changed without its table, fails),
    and every table names a results file that exists."""
    import importlib.util
    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("results_tables", root / "scripts" / "results_tables.py")
    rt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rt)
    assert rt.main(["--check"]) == 0
    names = {m.group(2) for md in [root / "README.md", *sorted((root / "docs").glob("*.md"))]
             for m in rt.BLOCK.finditer(md.read_text())}
    assert names, "no results tables"
    assert not [n for n in names if not (rt.RESULTS / f"{n}.json").is_file()]
