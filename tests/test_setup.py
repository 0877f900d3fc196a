"""The README's two commands: scripts/setup installs only what nvsymlinkd needs to run
(.ci/apt.d/runtime.txt), scripts/test (scripts/setup --test) everything the tests need.

The scripts run for real with a PATH where `dpkg-query` reports every package missing and `id`
says "not root", so they stop at the package step and name exactly what they would install.
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
APT = REPO / ".ci" / "apt.d"


def packages(path: Path) -> set:
    text = re.sub(r"#.*", "", path.read_text())
    return set(text.split())


def would_install(tmp_path, *args) -> set:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "dpkg-query").write_text("#!/bin/sh\nexit 1\n")
    (fake / "id").write_text("#!/bin/sh\necho 1000\n")
    for f in fake.iterdir():
        f.chmod(0o755)
    env = dict(os.environ, PATH=f"{fake}:/usr/bin:/bin")
    proc = subprocess.run([str(REPO / "scripts" / "setup"), *args], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stderr
    m = re.search(r"missing Debian packages:(.*); run as root", proc.stderr)
    assert m, proc.stderr
    return set(m.group(1).split())


def test_setup_installs_only_the_runtime_list(tmp_path):
    runtime = packages(APT / "runtime.txt")
    assert would_install(tmp_path) == runtime
    # no test tool sneaks into the main job's set-up
    assert not runtime & {"runc", "qemu-system-x86", "mmdebstrap", "lintian", "rpm", "linux-headers-amd64",
                          "python3-dbusmock", "umockdev"}


def test_setup_for_tests_installs_every_list(tmp_path):
    union = set()
    for f in APT.glob("*.txt"):
        union |= packages(f)
    got = would_install(tmp_path, "--test")
    assert got == union
    assert packages(APT / "runtime.txt") <= got


def test_setup_for_building_installs_only_the_build_list(tmp_path):
    """scripts/setup --build: what scripts/build-packages (and --repo) needs, nothing of the tests."""
    build = packages(APT / "build.txt")
    assert would_install(tmp_path, "--build") == build
    # every tool build-packages and make-repos call, and none that only the tests use
    assert {"dpkg-dev", "debhelper", "dh-python", "pybuild-plugin-pyproject", "python3-build", "rpm",
            "apt-utils", "createrepo-c"} <= build
    assert not build & {"lintian", "rpm2cpio", "runc", "qemu-system-x86", "mmdebstrap", "linux-headers-amd64",
                        "python3-dbusmock", "umockdev", "python3-pytest"}
    # the Build-Depends of debian/control, each in the list
    text = (REPO / "debian" / "control").read_text()
    bdeps = re.search(r"^Build-Depends:(.*?)^\S", text, re.M | re.S).group(1)
    names = {d.strip().split()[0] for d in bdeps.split(",") if d.strip()}
    assert names - {"debhelper-compat"} <= build, names - build


def test_setup_for_building_makes_no_venv(tmp_path):
    """The build runs /usr/bin/python3: on a machine with build.txt installed, --build makes no .venv."""
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    shutil.copy2(REPO / "scripts" / "setup", tree / "scripts" / "setup")
    shutil.copytree(APT, tree / ".ci" / "apt.d")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "dpkg-query").write_text("#!/bin/sh\necho 'install ok installed'\n")
    (fake / "dpkg-query").chmod(0o755)
    proc = subprocess.run([str(tree / "scripts" / "setup"), "--build"], env=dict(os.environ, PATH=f"{fake}:/usr/bin:/bin"),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "ready to build" in proc.stdout and not (tree / ".venv").exists()


def test_test_command_and_ci_use_the_full_set_up():
    assert "scripts/setup --test" in (REPO / "scripts" / "test").read_text()
    assert re.search(r"^scripts/test\b", (REPO / ".ci" / "run").read_text(), re.M)


def control_depends() -> set:
    text = (REPO / "debian" / "control").read_text()
    binary = text.split("\nPackage: nvsymlinkd\n", 1)[1]
    m = re.search(r"^Depends:(.*?)^\S", binary, re.M | re.S)
    return {d.strip().split()[0] for d in m.group(1).split(",") if d.strip() and not d.strip().startswith("$")}


def test_runtime_list_holds_the_package_depends():
    """What the .deb needs on a host is what scripts/setup installs for the checkout."""
    missing = control_depends() - packages(APT / "runtime.txt")
    assert not missing, f".ci/apt.d/runtime.txt lacks the .deb's Depends: {sorted(missing)}"


@pytest.mark.parametrize("arg", ["--bogus"])
def test_setup_rejects_unknown_arguments(arg):
    proc = subprocess.run([str(REPO / "scripts" / "setup"), arg], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "usage: scripts/setup [--test | --build]" in proc.stderr
