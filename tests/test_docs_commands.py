"""Every ``mpipe-tune`` command in README.md's and docs/'s code blocks parses with the CLI as written:
its subcommand, flags and choices exist (running them all is the stranger's check in benchmarks/README.md)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from mpipe_tune.cli import build_parser

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def commands(page: Path) -> list[str]:
    """The mpipe-tune command lines of ``page``'s fenced code blocks (continuations joined, comments,
    other commands of a chain and printed errors left out; ``-m mpipe_tune.cli`` under torchrun counts)."""
    found = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                if "mpipe_tune.cli" in words:
                    words = ["mpipe-tune", *words[words.index("mpipe_tune.cli") + 1:]]
                if words[:1] == ["mpipe-tune"] and not words[1].endswith(":"):  # not an error line shown
                    found.append(shlex.join(words))
    return found


CASES = [(page.relative_to(ROOT).as_posix(), command) for page in PAGES for command in commands(page)]


def test_the_pages_have_commands():
    assert len(CASES) > 30 and {page for page, _ in CASES} >= {"README.md", "docs/planning.md", "docs/exports.md"}


@pytest.mark.parametrize("page,command", CASES)
def test_a_documented_command_parses(page, command, capsys):
    try:
        build_parser().parse_args(shlex.split(command)[1:])
    except SystemExit:
        pytest.fail(f"{page}: '{command}' does not parse: {capsys.readouterr().err.strip().splitlines()[-1]}")


def test_the_export_guide_runs_as_written_on_the_example_plan(tmp_path, monkeypatch, capsys):
    """docs/exports.md's commands, run in order on the plan of the README's example (``plan.json``)."""
    from mpipe_tune.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--no-progress", "--out", "plan.json"]) == 0
    for command in commands(ROOT / "docs" / "exports.md"):
        capsys.readouterr()
        assert main(shlex.split(command)[1:]) == 0, f"'{command}': {capsys.readouterr().err.strip()}"


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives ``page``'s headings: lower case, punctuation dropped, spaces as hyphens."""
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in page.read_text(encoding="utf-8").splitlines() if line.startswith("#")}


def test_every_link_between_the_pages_resolves():
    broken = []
    for page in [*PAGES, ROOT / "benchmarks" / "README.md"]:
        for link in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            if link.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path) if path else page
            if not target.exists() or (anchor and target.suffix == ".md" and anchor not in anchors(target)):
                broken.append(f"{page.relative_to(ROOT)}: {link}")
    assert not broken, broken


def test_the_readme_s_command_table_lists_every_command_in_the_order_of_help(capsys):
    """README.md's table and ``mpipe-tune --help`` name the same commands in the same order."""
    table = re.search(r"## Commands\n(.*?)\n\n", (ROOT / "README.md").read_text(encoding="utf-8"), flags=re.S).group(1)
    in_table = [name for cell in re.findall(r"^\| (`mpipe-tune [^|]*?)\s*\|", table, flags=re.M)
                for name in re.findall(r"`mpipe-tune ([a-z]+)", cell)]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    listed = re.findall(r"^    ([a-z]+) ", capsys.readouterr().out, flags=re.M)
    assert in_table == listed


def test_the_input_guide_lists_every_architecture_kind_and_the_fields_it_needs():
    """docs/inputs.md's table is what a user writes a model file from: each kind's row names every required field."""
    from mpipe_tune.inputs import ARCH_KINDS

    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| ([^|]*) \|", (ROOT / "docs" / "inputs.md")
                                                        .read_text(encoding="utf-8"), flags=re.M)}
    assert set(rows) == set(ARCH_KINDS)
    for kind, needed in ARCH_KINDS.items():
        assert re.findall(r"`(\w+)`", rows[kind]) == list(needed), kind


def test_the_benchmarks_page_stays_a_page_of_latest_results():
    """benchmarks/README.md shows each benchmark's latest result, not its history (HISTORY.md keeps that)."""
    lines = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 400, f"benchmarks/README.md has {lines} lines: move earlier readings to benchmarks/HISTORY.md"
