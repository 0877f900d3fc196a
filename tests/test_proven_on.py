"""One source for each "proven on" fact (issue 29, item 5): docs/vm.md's scenario table lists every
VM scenario with the cells (hierarchies, default run or full matrix) its `# vm:` header gives; every
cell named anywhere in README.md or docs/ exists; and a cell's result (pass, fail, "not yet") is
stated in docs/vm.md alone, which the README and docs/operations.md link to instead of restating.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.vm import vmhost  # the scenario headers' one reader

REPO = Path(__file__).parent.parent

DEFAULT = set(vmhost.list_scenarios("default"))
FULL = set(vmhost.list_scenarios("full"))
STEMS = sorted(p.stem for p in vmhost.SCENARIOS_DIR.glob("s*.py"))
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
CELL = re.compile(r"(?<![\w/.-])(s\d\d[a-z]?)((?:_[a-z0-9]+)*)(@v[12])?(?![\w-])")
VERDICT_WORDS = re.compile(r"\bnot yet\b|\bFAIL(ED)?\b|\bfails\b|\bfroze\b")


def annotation(stem: str) -> str:
    """How docs/vm.md's scenario table says where a scenario runs, from its header."""
    opts = vmhost.scenario_options(stem)

    def words(hierarchies):
        return ["v2" if h == "v2" else f"`@{h}`" for h in hierarchies]

    if opts["matrix"] == "full":
        every = opts["hierarchies"].split(",") + (opts["full"].split(",") if opts["full"] else [])
        return "(full matrix only)" if every == ["v2"] else f"(full matrix only: {', and '.join(words(every))})"

    text = ", and ".join(words(opts["hierarchies"].split(",")))
    if opts["full"]:
        text += "; " + ", ".join(words(opts["full"].split(","))) + " in the full matrix"
    return "" if text == "v2" else f"({text})"


def scenario_rows() -> dict:
    text = (REPO / "docs/vm.md").read_text()
    section = text.split("## Scenarios", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\| `(s\d\d[a-z]?_\w+)`( \([^|]*\))? \|", line)
        if m:
            rows[m.group(1)] = (m.group(2) or "").strip()
    return rows


def test_every_scenario_has_its_row_with_its_cells():
    rows = scenario_rows()
    assert sorted(rows) == STEMS, (sorted(set(STEMS) - set(rows)), sorted(set(rows) - set(STEMS)))
    wrong = {s: (rows[s], annotation(s)) for s in STEMS if rows[s] != annotation(s)}
    assert not wrong, f"docs/vm.md scenario rows (as written, from the header): {wrong}"


def test_the_scenario_table_is_one_table():
    text = (REPO / "docs/vm.md").read_text()
    section = text.split("## Scenarios", 1)[1].split("\n## ", 1)[0]
    lines = section.strip().splitlines()
    table = [i for i, line in enumerate(lines) if line.startswith("|")]
    assert table == list(range(table[0], table[-1] + 1)), "a blank line splits docs/vm.md's scenario table"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_cell_named_in_the_docs_exists(doc):
    missing = []
    for m in CELL.finditer(doc.read_text()):
        prefix, rest, hierarchy = m.group(1), m.group(2), m.group(3)
        stems = [s for s in STEMS if s == prefix + rest or (not rest and s.split("_")[0] == prefix)]
        if not stems:
            if rest:  # a full name that is no scenario
                missing.append(m.group(0))
            continue
        if hierarchy and not any((s if hierarchy == "@v2" else s + hierarchy) in FULL for s in stems):
            missing.append(m.group(0))
    assert not missing, f"{doc.name} names cells no scenario header defines: {missing}"


@pytest.mark.parametrize("doc", [REPO / "README.md", REPO / "docs/operations.md"], ids=lambda p: p.name)
def test_results_are_stated_in_vm_md_alone(doc):
    """A cell's verdict lives in docs/vm.md; the front door and the cluster guide link to it."""
    said = [line for line in doc.read_text().splitlines() if VERDICT_WORDS.search(line)
            and any(m.group(2) or m.group(3) for m in CELL.finditer(line))]  # a cell: full name or NAME@vN
    assert not said, f"{doc.name} states a cell's result (say it in docs/vm.md, link there): {said}"


def test_the_pod_proofs_named_in_the_front_door_run_somewhere():
    readme = (REPO / "README.md").read_text()
    proven = readme.split("## Proven on", 1)[1].split("\n## ", 1)[0]
    named = {m.group(0) for m in CELL.finditer(proven)}
    for cell in ("s20_pod_keeps_gpu", "s20_pod_keeps_gpu@v1", "s21_pod_rolling_and_overlays@v1"):
        assert cell in named, f"README's Proven on names the DaemonSet's cells: {cell}"
        assert cell in FULL
    # what CI runs by default, as the docs say: s20's cell, which runs s21's proofs in its boot
    # (tests/vm/test_vm_e2e.py::test_pod_scenarios_default_and_full)
    assert "s20_pod_keeps_gpu" in DEFAULT and not any(c.startswith("s21_") for c in DEFAULT)
