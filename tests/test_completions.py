"""Shell completion (issue 29, item 7): bash, zsh and fish scripts that load in their shells, offer
every command and option, and complete CONTAINER for check and repair with the GPU containers' ids
and names (`nvsymlinkd complete-containers`, a command for the completions only, hidden from --help).
Each shell is the real one: bash calls the function, zsh completes in a pty (tests/zcomplete.zsh),
fish answers `complete -C`. The containers are real runc containers seen through --root.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nvsymlinkd.cli import HIDDEN_COMMANDS, build_parser
from tests.conftest import need_tool
from tests.runcfixture import device_node, device_rule

REPO = Path(__file__).parent.parent
COMPLETIONS = REPO / "completions"
K8S = {"io.kubernetes.cri.sandbox-namespace": "ml", "io.kubernetes.cri.sandbox-name": "train-0",
       "io.kubernetes.cri.container-name": "cuda"}


def subcommands() -> dict:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if hasattr(a, "choices") and isinstance(a.choices, dict)]
    return {k: v for k, v in sub.choices.items() if k not in HIDDEN_COMMANDS}


def options(parser) -> set:
    return {o for a in parser._actions for o in a.option_strings if o.startswith("--")} - {"--help"}


@pytest.fixture
def shim(tmp_path) -> dict:
    """PATH with an `nvsymlinkd` that runs this checkout, as an installed one would."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "nvsymlinkd").write_text(f'#!/bin/sh\nexec {sys.executable} -m nvsymlinkd "$@"\n')
    (bindir / "nvsymlinkd").chmod(0o755)
    return {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "PYTHONPATH": str(REPO)}


@pytest.fixture
def gpu_pod(runc_host, monkeypatch):
    monkeypatch.delenv("DBUS_SYSTEM_BUS_ADDRESS", raising=False)
    runc_host.run("gpu-comp", rules=[device_rule(195, 0)], nodes=[device_node("/dev/nvidia0", 195, 0)],
                  env=["NVIDIA_VISIBLE_DEVICES=0"], annotations=K8S)
    runc_host.run("plain-comp")  # no GPU: never offered
    return runc_host


WANT = {"gpu-comp", "cuda", "ml/train-0", "ml/train-0/cuda"}  # every word find() takes


def test_complete_containers_lists_gpu_containers_and_is_hidden(gpu_pod, shim):
    out = subprocess.run(["nvsymlinkd", "--root", str(gpu_pod.root), "complete-containers"], env=shim,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and set(out.stdout.split()) == WANT, out.stdout + out.stderr
    helptext = subprocess.run(["nvsymlinkd", "--help"], env=shim, capture_output=True, text=True).stdout
    assert "complete-containers" not in helptext


def test_bash(gpu_pod, shim):
    bash = need_tool("bash")
    script = (f'source {COMPLETIONS / "nvsymlinkd"}; COMP_WORDS=(nvsymlinkd --root {gpu_pod.root} repair ml/); '
              'COMP_CWORD=4; _nvsymlinkd; printf "%s\\n" "${COMPREPLY[@]}"')
    out = subprocess.run([bash, "--norc", "-c", script], env=shim, capture_output=True, text=True, timeout=60)
    assert set(out.stdout.split()) == {"ml/train-0", "ml/train-0/cuda"}, out.stdout + out.stderr


def zsh_offers(line: str, env: dict) -> set:
    zsh = need_tool("zsh")
    out = subprocess.run([zsh, "-f", str(Path(__file__).parent / "zcomplete.zsh"), str(COMPLETIONS), line],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def test_zsh(gpu_pod, shim):
    assert zsh_offers("nvsymlinkd ", shim) >= set(subcommands())
    assert WANT <= zsh_offers(f"nvsymlinkd --root {gpu_pod.root} check ", shim)
    assert {"--force", "--dry-run", "--json"} <= zsh_offers("nvsymlinkd repair --", shim)


def fish_offers(line: str, env: dict) -> set:
    fish = need_tool("fish")
    script = f"source {COMPLETIONS / 'nvsymlinkd.fish'}; complete -C {quote(line)}"
    out = subprocess.run([fish, "--no-config", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and not out.stderr, out.stderr
    return {line.split("\t")[0] for line in out.stdout.splitlines()}


def quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def test_fish(gpu_pod, shim):
    assert fish_offers("nvsymlinkd ", shim) >= set(subcommands())
    assert WANT <= fish_offers(f"nvsymlinkd --root {gpu_pod.root} check ", shim)
    assert {"--force", "--dry-run", "--json"} <= fish_offers("nvsymlinkd repair --", shim)


def test_zsh_and_fish_know_every_command_and_option():
    zsh_text = (COMPLETIONS / "_nvsymlinkd").read_text()
    fish_text = (COMPLETIONS / "nvsymlinkd.fish").read_text()
    missing = []
    for command, parser in subcommands().items():
        if f"{command})" not in zsh_text or not re.search(rf"-a {command} ", fish_text):
            missing.append(command)
        for opt in sorted(options(parser)):
            if not re.search(rf"'{re.escape(opt)}(\[|')", zsh_text) and f"{opt}[" not in zsh_text:
                missing.append(f"zsh: {command} {opt}")
            if not re.search(rf"from [a-z ]*\b{command}\b[a-z ]*' -l {re.escape(opt[2:])}\b", fish_text) \
                    and f"-l {opt[2:]} " not in fish_text.split("complete -c nvsymlinkd -n \"not")[0] + \
                    "".join(ln for ln in fish_text.splitlines(True) if " -n " not in ln):
                missing.append(f"fish: {command} {opt}")
    assert not missing, missing


# -- names are data (issue 39, item 1) ---------------------------------------------------------------
# Cgroup names a container with a writable cgroup tree can make below its own cgroup (anything but `/`),
# each of which would run `touch edges-pwned-N` in the completing shell's directory if a shell expanded it.
# (The kernel refuses a newline in a cgroup's name, EINVAL: newlines only reach the shells through a producer.)
HOSTILE = (
    "$(touch${IFS}edges-pwned-1).scope",
    "`touch${IFS}edges-pwned-2`.scope",
    "a;touch${IFS}edges-pwned-3;[a-z]*.scope",
    "runc-$(touch${IFS}edges-pwned-4)*.scope",
)
NEWLINES = "x\n$(touch${IFS}edges-pwned-5)\n`touch${IFS}edges-pwned-6`\n*.scope"
READY = {"bash": "echo READY-$((40+2))", "fish": "echo READY-(math 40 + 2)"}


def pty_complete(shell: str, line: str, env: dict, cwd: Path) -> str:
    """What an interactive `shell` shows after the user types `line` and presses TAB twice, in a real pty."""
    import fcntl
    import select
    import termios
    import time

    if shell == "bash":
        argv = [need_tool("bash"), "--norc", "--noprofile", "-i"]
        setup = [f"source {COMPLETIONS / 'nvsymlinkd'}", "bind 'set show-all-if-ambiguous on'",
                 "bind 'set completion-query-items 0'", "bind 'set page-completions off'"]
    else:
        argv = [need_tool("fish"), "--no-config", "-i"]
        setup = [f"source {COMPLETIONS / 'nvsymlinkd.fish'}"]
    master, slave = os.openpty()

    def controlling_tty() -> None:  # the pty as the shell's terminal, as a terminal emulator gives it
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env={**env, "TERM": "dumb"}, cwd=cwd,
                            preexec_fn=controlling_tty)
    os.close(slave)
    out = b""

    def read_for(seconds: float, until: bytes | None = None) -> None:
        nonlocal out
        end = time.monotonic() + seconds
        while time.monotonic() < end and not (until and until in out):
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    out += os.read(master, 65536)
                except OSError:
                    return

    try:
        os.write(master, ("\n".join(setup + [READY[shell]]) + "\n").encode())
        read_for(20, b"READY-42")
        assert b"READY-42" in out, out.decode(errors="replace")
        mark = len(out)
        os.write(master, line.encode() + b"\t")
        read_for(4)
        os.write(master, b"\t")
        read_for(4)
        os.write(master, b"\x03")  # ^C: the line is never run
        read_for(0.5)
        return out[mark:].decode(errors="replace")
    finally:
        proc.kill()
        proc.wait()
        os.close(master)


def offered_by(shell: str, line: str, env: dict, cwd: Path) -> str:
    if shell == "zsh":
        out = subprocess.run([need_tool("zsh"), "-f", str(Path(__file__).parent / "zcomplete.zsh"), str(COMPLETIONS),
                              line], env=env, capture_output=True, text=True, timeout=60, cwd=cwd)
        return out.stdout
    return pty_complete(shell, line, env, cwd)


@pytest.fixture
def hostile_shim(tmp_path) -> dict:
    """PATH with an `nvsymlinkd` whose complete-containers prints what a container named, unfiltered (an older
    nvsymlinkd; any producer with a bug): the shells alone must keep it from running."""
    bindir = tmp_path / "hostile-bin"
    bindir.mkdir()
    words = "".join(w + "\n" for w in ("gpu-edges-good", *HOSTILE, NEWLINES))
    (tmp_path / "words").write_text(words)
    (bindir / "nvsymlinkd").write_text(f'#!/bin/sh\n[ "$1" = complete-containers ] && cat {tmp_path / "words"}\n')
    (bindir / "nvsymlinkd").chmod(0o755)
    return {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_a_name_offered_to_a_shell_is_never_run(shell, hostile_shim, tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    shown = offered_by(shell, "nvsymlinkd check ", hostile_shim, cwd)
    assert "gpu-edges-good" in shown, shown  # the completion ran and offered the good name
    assert sorted(os.listdir(cwd)) == [], shown  # and nothing it was handed ran
    assert "edges-pwned" not in shown, shown  # nor was offered


def move_init(c, name: str) -> None:
    """Where a container with a writable cgroup tree may put itself: a child cgroup of its own, any name."""
    for hierarchy in ("unified", "systemd", "devices"):
        here = Path("/sys/fs/cgroup") / hierarchy / c.cgroups_path.lstrip("/")
        if (here / "cgroup.procs").exists() and str(c.pid) in (here / "cgroup.procs").read_text().split():
            (here / name).mkdir()
            (here / name / "cgroup.procs").write_text(f"{c.pid}\n")


def test_container_made_cgroup_names_never_reach_a_shell(runc_host, shim, tmp_path, monkeypatch):
    """End to end: real runc GPU containers whose inits moved into cgroups named to run a command; what
    `complete-containers` offers comes from the runtime (ids, names), and TAB in each shell runs nothing."""
    monkeypatch.delenv("DBUS_SYSTEM_BUS_ADDRESS", raising=False)
    for i, name in enumerate(HOSTILE):
        c = runc_host.run(f"gpu-edges-{i}", rules=[device_rule(195, 0)], nodes=[device_node("/dev/nvidia0", 195, 0)],
                          env=["NVIDIA_VISIBLE_DEVICES=0"])
        move_init(c, name)
        assert name.split("\n")[0] in Path(f"/proc/{c.pid}/cgroup").read_text()
    out = subprocess.run(["nvsymlinkd", "--root", str(runc_host.root), "complete-containers"], env=shim,
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.split("\n") == [f"gpu-edges-{i}" for i in range(len(HOSTILE))] + [""], out.stdout + out.stderr
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    for shell in ("bash", "zsh", "fish"):
        shown = offered_by(shell, f"nvsymlinkd --root {runc_host.root} check gpu-edges-", shim, cwd)
        assert re.search(r"gpu-edges-\d", shown), (shell, shown)  # a real container offered (fish: inserted)
        assert sorted(os.listdir(cwd)) == [], (shell, shown)
