"""How the command line is used and told: each command's one-line summary, the help formatter, the usage
error, and fix hints that name this run's --root. Shared by cli and every commands/ module (which cli loads
by name: they import this, never cli). Cheap to import: argparse and re only.
"""

from __future__ import annotations

import argparse
import re

from nvsymlinkd.errors import UsageError

# the subparser's help= of each command in cli.COMMANDS, so `nvsymlinkd --help` lists every command
# without importing them
SUMMARIES = {
    "sync": "create, fix and remove /dev/char/M:m links for NVIDIA nodes, once",
    "run": "run the event daemon: keep /dev/char exact as nodes, modules and systemd change",
    "render": "write (or print) the udev rule and systemd units for this config",
    "check": "verify GPU containers' device access and the host (read-only)",
    "repair": "re-grant NVIDIA devices GPU containers lost (or are about to lose)",
}


# An example in an epilog: its command, two or more spaces, its `# comment`
_EXAMPLE = re.compile(r"(\s*)(\S.*?)\s{2,}(#.*)")


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter at the terminal's width (argparse asks shutil.get_terminal_size: COLUMNS, then
    the terminal, then 80 for a pipe), with descriptions and epilogs as paragraphs: one of plain lines is
    filled to the width; an indented block (the examples) keeps its lines, and one too long is wrapped
    (an example's `# comment` that does not fit goes on the line below it)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        import textwrap

        out = []
        for para in text.strip("\n").split("\n\n"):
            lines = para.splitlines()
            if not any(line[:1].isspace() for line in lines):
                out.append(textwrap.fill(" ".join(line.strip() for line in lines), width, initial_indent=indent,
                                         subsequent_indent=indent, break_on_hyphens=False, break_long_words=False))
                continue
            block: list[str] = []
            lead = "  "
            for line in lines:
                if line.strip() and not line.lstrip().startswith("#"):
                    lead = line[:len(line) - len(line.lstrip())]
                if len(indent + line) <= width:
                    block.append(indent + line)
                    continue
                m = _EXAMPLE.fullmatch(line)
                if m is not None:  # the command, then its comment below it
                    block.append(indent + m.group(1) + m.group(2))
                    line = m.group(3)
                deeper = indent + lead + "    "
                block += textwrap.wrap(line.strip(), width, initial_indent=deeper, subsequent_indent=deeper + "  ",
                                       break_on_hyphens=False, break_long_words=False)
            out.append("\n".join(block))
        return "\n\n".join(out)


class CommandLineError(UsageError):
    """argparse's complaint, printed after the usage line as `nvsymlinkd: error: ...` (a command's own
    check of its options raises it too)."""


_COMMAND_HINT = re.compile(r"\bnvsymlinkd (?=(?:sync|run|render|check|repair)\b)")


def with_root(text: str, root) -> str:
    """A fix hint that names an nvsymlinkd command, with this run's --root put in (so it can be pasted)."""
    if not text or root.is_real_root:
        return text
    import shlex  # only with --root: not on every command's start

    return _COMMAND_HINT.sub(f"nvsymlinkd --root {shlex.quote(root.root)} ", text)
