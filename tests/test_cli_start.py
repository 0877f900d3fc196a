"""`nvsymlinkd sync`'s start stays light (issue 16: the process wall near a bare interpreter's):
only the command that runs has its module imported and its parser built, and the help and
errors the operator sees are those of the full parser, whichever command argv names."""

import os
import subprocess
import sys

import pytest

from nvsymlinkd.cli import COMMANDS, build_parser
from tests.fakehost import standard_host


def python(code: str, *argv, env=None):
    return subprocess.run([sys.executable, "-c", code, *map(str, argv)], capture_output=True, text=True,
                          timeout=120, env=env)


# what the process imported, after main() ran the command argv names
MODULES_AFTER = """
import sys
from nvsymlinkd.cli import main
rc = main(sys.argv[1:])
sys.stdout.flush()
print("MODULES", " ".join(sorted(sys.modules)))
"""


def modules_after(*argv) -> set:
    proc = python(MODULES_AFTER, *argv)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("MODULES ")]
    assert lines, proc.stdout + proc.stderr
    return set(lines[-1].split()[1:])


# what every command shares with cli (cheap: argparse, re, sys), not a command
SHARED = {"nvsymlinkd.commands.usage", "nvsymlinkd.commands.output"}


def test_sync_imports_no_other_command_nor_what_it_does_not_use(tmp_path, need_root):
    host = standard_host(tmp_path)
    mods = modules_after("--root", host.root, "sync")
    assert {m for m in mods if m.startswith("nvsymlinkd.commands.")} - SHARED == {"nvsymlinkd.commands.sync"}
    # json: only for --json or a JSON error; shlex: only for a hint with --root; shutil: argparse's
    # terminal width, only when help or usage is printed; dataclasses (and inspect with it): the
    # value classes on sync's path are nvsymlinkd.record's
    assert not {"json", "shlex", "shutil", "dataclasses", "inspect"} & mods


def test_a_command_after_global_options_still_gets_its_own_parser(tmp_path, need_root):
    host = standard_host(tmp_path)
    mods = modules_after("--root", host.root, "--config", "/nonexistent.toml", "check", "--json")
    assert {m for m in mods if m.startswith("nvsymlinkd.commands.")} - SHARED == {"nvsymlinkd.commands.check"}


def full_help(command) -> str:
    parser = build_parser()
    if command is None:
        return parser.format_help()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices[command].format_help()


@pytest.mark.parametrize("columns", ["60", "200"])
@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_printed_is_the_full_parsers(command, columns):
    env = dict(os.environ, COLUMNS=columns)
    argv = [command, "--help"] if command else ["--help"]
    proc = subprocess.run([sys.executable, "-m", "nvsymlinkd", *argv], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    want = python(f"from tests.test_cli_start import full_help; print(full_help({command!r}), end='')",
                  env=dict(env, PYTHONPATH=os.path.dirname(os.path.dirname(__file__)))).stdout
    assert proc.stdout == want


@pytest.mark.parametrize("argv, error", [
    ([], "the following arguments are required: COMMAND"),
    (["bogus"], "argument COMMAND: invalid choice: 'bogus'"),
    (["sync", "--bogus"], "unrecognized arguments: --bogus"),
    (["--root"], "argument --root: expected one argument"),
    (["check", "--since"], "unrecognized arguments: --since"),
])
def test_usage_errors_are_one_line_after_the_usage(argv, error):
    proc = subprocess.run([sys.executable, "-m", "nvsymlinkd", *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("usage: nvsymlinkd"), proc.stderr
    assert lines[-1].startswith(f"nvsymlinkd: error: {error}"), proc.stderr
