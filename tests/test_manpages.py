"""The man pages are the CLI reference (man/*.rst, built with docutils' manpage writer by the packages).

Every argparse option of every command, every config key, journal MESSAGE_ID, metric, finding kind
and repair status must appear in its page, and the bash completion must know every option. A failure
names the page and what to add, e.g.

    man/nvsymlinkd-render.8.rst: `nvsymlinkd render --drop-ins` is not documented: add a '**--drop-ins**'
    entry under OPTIONS
"""

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nvsymlinkd import journal, metrics
from nvsymlinkd.cli import COMMANDS, HIDDEN_COMMANDS, build_parser
from nvsymlinkd.config import KEYS
from nvsymlinkd.repair import apply as repairer
from nvsymlinkd.repair.model import RepairStatus
from nvsymlinkd.verify import evaluate
from nvsymlinkd.verify import kinds as findingkinds

REPO = Path(__file__).resolve().parent.parent
MAN = REPO / "man"
MAIN_PAGE = "nvsymlinkd.8.rst"
CONFIG_PAGE = "nvsymlinkd.toml.5.rst"
COMPLETION = REPO / "completions" / "nvsymlinkd"


def page_of(command) -> str:
    return MAIN_PAGE if command is None else f"nvsymlinkd-{command}.8.rst"


def read_page(name: str) -> str:
    path = MAN / name
    assert path.is_file(), f"man/{name} is missing: every command has its page (copy man/nvsymlinkd-sync.8.rst)"
    return path.read_text()


def subcommands() -> dict:
    parser = build_parser()
    out = {None: parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            out.update((k, v) for k, v in action.choices.items() if k not in HIDDEN_COMMANDS)
    return out


def documented_names(parser, skip=frozenset()):
    """(what the page must show, how) for each option and positional argument of a parser.

    `skip`: option strings documented elsewhere (the global options a subcommand also accepts)."""
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if skip.intersection(action.option_strings):
            continue
        if action.option_strings:
            for opt in action.option_strings:
                if opt.startswith("--"):
                    yield f"**{opt}**", opt
        else:
            metavar = action.metavar or action.dest.upper()
            yield f"*{metavar}*", metavar


def test_every_command_has_its_page():
    assert set(subcommands()) - {None} == set(COMMANDS)
    for command in COMMANDS:
        read_page(page_of(command))


def test_every_cli_option_is_in_its_man_page():
    missing = []
    parsers = subcommands()
    # global options are accepted after the subcommand too, and documented once, in nvsymlinkd(8)
    global_options = frozenset(o for a in parsers[None]._actions for o in a.option_strings)
    for command, parser in parsers.items():
        text = read_page(page_of(command))
        synopsis = text.split("SYNOPSIS", 1)[-1].split("DESCRIPTION", 1)[0]
        # definition-list terms: unindented lines of the OPTIONS sections
        body = text.split("DESCRIPTION", 1)[-1]
        terms = "\n".join(line for line in body.splitlines() if line.startswith("*"))
        shown = "nvsymlinkd" + (f" {command}" if command else "")
        for needle, name in documented_names(parser, global_options if command else frozenset()):
            if needle not in terms or needle.split("*")[-3 if needle.startswith("**") else 1] not in synopsis:
                missing.append(f"man/{page_of(command)}: `{shown} {name}` is not documented: add a '{needle}' "
                               f"entry under {'GLOBAL OPTIONS' if command is None else 'OPTIONS'} (and the SYNOPSIS)")
    assert not missing, "\n".join(missing)


def test_every_command_is_in_the_main_page():
    text = read_page(MAIN_PAGE)
    missing = [c for c in COMMANDS if f"**{c}**" not in text or f"**nvsymlinkd-{c}**\\ (8)" not in text]
    assert not missing, f"man/{MAIN_PAGE}: add each command under COMMANDS and SEE ALSO: {missing}"


def test_every_config_key_is_in_the_config_page():
    text = read_page(CONFIG_PAGE)
    missing = [k.name for k in KEYS if not re.search(rf"^\*\*{re.escape(k.name)}\*\* = ", text, re.M)]
    assert not missing, (f"man/{CONFIG_PAGE}: config keys not documented: {missing}; add a '**KEY** = DEFAULT' "
                         f"entry under KEYS")


def test_every_message_id_is_in_the_main_page():
    text = read_page(MAIN_PAGE)
    missing = [f"{kind} {mid}" for kind, mid in journal.MESSAGE_IDS.items()
               if not re.search(rf"^\*\*{re.escape(kind)}\*\* \([a-z]+\)\n    {mid}$", text, re.M)]
    assert not missing, f"man/{MAIN_PAGE}: add these to the JOURNAL list ('**KIND** (PRIORITY)', then the ID): {missing}"


def test_every_metric_is_in_the_run_page():
    names = set(re.findall(r"\bnvsymlinkd_[a-z_]+[a-z]", Path(metrics.__file__).read_text()))
    text = read_page(page_of("run"))
    missing = sorted(n for n in names if f"**{n}**" not in text)
    assert not missing, f"man/{page_of('run')}: add these under METRICS: {missing}"


def test_every_finding_kind_and_repair_status_is_documented():
    check = read_page(page_of("check"))
    missing = [k.value for k in (evaluate.OK, *evaluate.KINDS) if f"**{k.value}**" not in check
               or journal.MESSAGE_IDS[findingkinds.JOURNAL_KINDS[k]] not in check]
    assert not missing, f"man/{page_of('check')}: add these under FINDING KINDS, with their MESSAGE_ID: {missing}"
    repair = read_page(page_of("repair"))
    missing = [s.value for s in RepairStatus if f"**{s.value}**" not in repair]
    assert not missing, f"man/{page_of('repair')}: add these under STATUSES: {missing}"
    kinds = (*repairer.JOURNAL_KINDS.values(), "repair-thawed")
    missing = [f"{k} {journal.MESSAGE_IDS[k]}" for k in kinds if f"**{k}** {journal.MESSAGE_IDS[k]}" not in repair]
    assert not missing, f"man/{page_of('repair')}: add these under JOURNAL: {missing}"


@pytest.mark.parametrize("page", sorted(p.name for p in MAN.glob("*.rst")))
def test_page_builds_without_warnings(page, tmp_path):
    core = pytest.importorskip("docutils.core")
    out = tmp_path / "page"
    core.publish_file(source_path=str(MAN / page), destination_path=str(out), writer_name="manpage",
                      settings_overrides={"halt_level": 2, "report_level": 2})
    section = page.split(".")[-2]
    assert re.search(rf'^\.TH "?[^ ]+"? "?{section}"?', out.read_text(), re.M)


def completion_options() -> dict:
    text = COMPLETION.read_text()
    out = {None: set(re.search(r'local global="([^"]*)"', text).group(1).split())}
    out["commands"] = set(re.search(r'local commands="([^"]*)"', text).group(1).split())
    for command, opts in re.findall(r'^\s+(\w+)\) opts="([^"]*)"', text, re.M):
        out[command] = set(opts.split())
    return out


def test_bash_completion_knows_every_command_and_option():
    got = completion_options()
    assert got["commands"] == set(COMMANDS), f"{COMPLETION}: the commands list must be {sorted(COMMANDS)}"
    missing = []
    for command, parser in subcommands().items():
        want = {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
        lack = want - got.get(command, set())
        if lack:
            missing.append(f"{COMPLETION.relative_to(REPO)}: add {sorted(lack)} to the "
                           f"{'global' if command is None else command + ') opts'} list")
    assert not missing, "\n".join(missing)


def complete(words, tmp_path):
    script = (f"source {COMPLETION}; COMP_WORDS=({' '.join(repr(w) for w in words)}); "
              f"COMP_CWORD={len(words) - 1}; _nvsymlinkd; printf '%s\\n' \"${{COMPREPLY[@]}}\"; "
              "complete -p nvsymlinkd")
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_bash_completion_completes_in_plain_bash(tmp_path):
    (tmp_path / "units").mkdir()
    assert "check" in complete(["nvsymlinkd", "--root", "/", "ch"], tmp_path)
    assert complete(["nvsymlinkd", "repair", "--d"], tmp_path)[:1] == ["--dry-run"]
    assert complete(["nvsymlinkd", "render", "--output", "un"], tmp_path)[:1] == ["units"]


def run_cli(*argv):
    return subprocess.run([sys.executable, "-m", "nvsymlinkd", *argv], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_has_examples_and_points_at_the_man_page(command):
    argv = [command, "--help"] if command else ["--help"]
    proc = run_cli(*argv)
    assert proc.returncode == 0
    assert "examples:\n  nvsymlinkd " in proc.stdout or "examples:\n  systemctl " in proc.stdout
    assert f"man {page_of(command).rsplit('.', 2)[0]}" in proc.stdout
    assert "README" not in proc.stdout


def test_config_error_points_at_the_config_man_page(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("driver_root = \n")
    proc = run_cli("--config", str(bad), "sync", "--dry-run")
    assert proc.returncode == 2
    assert "see man nvsymlinkd.toml" in proc.stderr and "README" not in proc.stderr
