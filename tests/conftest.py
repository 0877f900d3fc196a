import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

IN_CI = os.environ.get("CI") == "true"


def _skip_or_fail(reason: str):
    # In CI every marked test must really run: a missing prerequisite is a CI setup bug.
    if IN_CI:
        pytest.fail(f"CI must run this test, but: {reason} (install it in .ci/run)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture
def need_root():
    if os.geteuid() != 0:
        _skip_or_fail("needs root (mknod, cgroups)")


@pytest.fixture
def example_base(need_root):
    """A root-owned scratch directory for property tests: hypothesis runs many examples in one
    function call, so each example makes its own directory under this one (tmp_path is per call)."""
    d = Path(tempfile.mkdtemp(prefix="nvsymlinkd-examples-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def need_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        _skip_or_fail(f"needs the '{name}' tool")
    return path


@pytest.fixture
def fakehost(tmp_path, need_root):
    from tests.fakehost import FakeHost

    return FakeHost(tmp_path / "root")


@pytest.fixture
def nvsymlinkd_cli():
    """Run the real CLI as a subprocess: (argv...) -> CompletedProcess."""

    def run(*argv, check=None):
        proc = subprocess.run([sys.executable, "-m", "nvsymlinkd", *map(str, argv)],
                              capture_output=True, text=True, timeout=120)
        if check is not None and proc.returncode != check:
            raise AssertionError(f"exit {proc.returncode} != {check}\nstdout:{proc.stdout}\nstderr:{proc.stderr}")
        return proc

    return run


def _need(what: str, ok: bool) -> None:
    if not ok:
        _skip_or_fail(f"needs {what}")


@pytest.fixture
def runc_host(tmp_path, need_root):
    """Real runc containers (busybox rootfs, cgroupfs driver) seen through a fake host tree; all cleaned up.

    Needs the cgroup v1 devices controller: tests change access the way hooks and admins do
    (devices.allow/deny), which runc 1.1.5 programs where v1 devices is mounted (hybrid hosts like CI).
    """
    from tests.runcfixture import RuncHost

    runc = need_tool("runc")
    _need("/bin/busybox (busybox-static)", os.path.exists("/bin/busybox"))
    _need("the cgroup v1 devices controller", os.path.exists("/sys/fs/cgroup/devices/devices.list"))
    host = RuncHost(tmp_path / "runc", runc)
    try:
        yield host
    finally:
        host.cleanup()


# Real cgroup v1 device cgroups under a throwaway parent (the verifier's and the hostile-input tests').
V1_DEVICES = Path("/sys/fs/cgroup/devices")


@pytest.fixture
def v1_parent(need_root):
    if not (V1_DEVICES / "devices.list").exists():
        if IN_CI:
            pytest.fail("CI must run this test on a host with the cgroup v1 devices controller", pytrace=False)
        pytest.skip("needs the cgroup v1 devices controller")
    name = f"nvsymlinkd-test-{uuid.uuid4().hex[:8]}"
    (V1_DEVICES / name).mkdir()
    try:
        yield name
    finally:
        for d in sorted((V1_DEVICES / name).iterdir(), reverse=True):
            if d.is_dir():
                d.rmdir()
        (V1_DEVICES / name).rmdir()


def v1_cgroup(parent: str, leaf: str, allow: list) -> str:
    d = V1_DEVICES / parent / leaf
    d.mkdir()
    (d / "devices.deny").write_text("a\n")
    for rule in allow:
        (d / "devices.allow").write_text(rule + "\n")
    return f"/{parent}/{leaf}"


@pytest.fixture(autouse=True)
def fresh_systemd_client():
    """Each test's bus calls on a client of its own: the process's one systemd client (systemd/client.py)
    keeps its connection between calls, and tests start and stop private buses."""
    yield
    client = sys.modules.get("nvsymlinkd.systemd.client")
    if client is not None:
        client.reset_shared()
