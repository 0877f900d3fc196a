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
