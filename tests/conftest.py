import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

IN_CI = os.environ.get("CI") == "true"


def skip_or_fail(reason: str):
    # In CI every marked test must really run: a missing prerequisite is a CI setup bug.
    if IN_CI:
        pytest.fail(f"CI must run this test, but: {reason} (install it in .ci/run)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture
def need_root():
    if os.geteuid() != 0:
        skip_or_fail("needs root (mknod, cgroups)")


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
        skip_or_fail(f"needs the '{name}' tool")
    return path


@pytest.fixture
def fakehost(tmp_path, need_root):
    from tests.fakehost import FakeHost

    return FakeHost(tmp_path / "root")


# -- the fake GPU hosts: tests/fakehost.py's standard_host, one fixture name per make-up -------------------
@pytest.fixture
def gpu_host(tmp_path, need_root):
    """standard_host: the 535-style frontend, uvm, nvidiactl, modeset and two GPUs."""
    from tests.fakehost import standard_host

    return standard_host(tmp_path / "root")


@pytest.fixture
def gpu_host_null(gpu_host):
    """gpu_host with /dev/null."""
    return gpu_host.with_dev_null()


@pytest.fixture
def caps_host(gpu_host):
    """gpu_host whose /proc/devices also names nvidia-caps (CAPS_MAJOR), so the daemon links its nodes."""
    return gpu_host.with_caps_major()


@pytest.fixture
def caps_host_null(caps_host):
    """caps_host with /dev/null."""
    return caps_host.with_dev_null()


@pytest.fixture
def settled_caps_host(caps_host_null):
    """caps_host_null with /dev/nvidia-caps and /dev/char made (the daemon's first pass would make /dev/char,
    and that costs a second full pass)."""
    caps_host_null.path("/dev/nvidia-caps").mkdir()
    caps_host_null.path("/dev/char").mkdir()
    return caps_host_null


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


def require(what: str, ok: bool) -> None:
    if not ok:
        skip_or_fail(f"needs {what}")


@pytest.fixture
def runc_host(tmp_path, need_root):
    """Real runc containers (busybox rootfs, cgroupfs driver) seen through a fake host tree; all cleaned up.

    Needs the cgroup v1 devices controller: tests change access the way hooks and admins do
    (devices.allow/deny), which runc 1.1.5 programs where v1 devices is mounted (hybrid hosts like CI).
    """
    from tests.runcfixture import RuncHost

    runc = need_tool("runc")
    require("/bin/busybox (busybox-static)", os.path.exists("/bin/busybox"))
    require("the cgroup v1 devices controller", os.path.exists("/sys/fs/cgroup/devices/devices.list"))
    host = RuncHost(tmp_path / "runc", runc)
    try:
        yield host
    finally:
        host.cleanup()


@pytest.fixture
def no_system_bus(monkeypatch):
    """The fake tree is not the real host: never ask the machine's own systemd about its scopes."""
    monkeypatch.delenv("DBUS_SYSTEM_BUS_ADDRESS", raising=False)


# -- systemd on a private bus (python-dbusmock) --------------------------------------------------------
def need_bus_parts() -> None:
    """What the daemon needs to talk to a mock systemd and journal what it sees."""
    need_tool("dbus-daemon")
    try:
        import dbus  # noqa: F401  (python3-dbus)
        import dbusmock  # noqa: F401
        import systemd.journal  # noqa: F401  (python3-systemd: the daemon's journal sender)
    except ImportError as exc:
        skip_or_fail(str(exc))


@pytest.fixture
def systemd_mock(tmp_path, need_root):
    """test_repair_dbus's SystemdMock (GetUnit, scopes' DeviceAllow, SetUnitProperties re-applying v1 policy),
    DBUS_SYSTEM_BUS_ADDRESS left as it is."""
    from tests.privatebus import need_dbusmock
    from tests.test_repair_dbus import SystemdMock

    need_dbusmock()
    m = SystemdMock(tmp_path / "sdbus")
    try:
        m.start()
        yield m
    finally:
        m.close()


@pytest.fixture
def systemd(tmp_path, need_root, monkeypatch):
    """systemd_mock that this process's clients reach (DBUS_SYSTEM_BUS_ADDRESS names its bus)."""
    from tests.privatebus import need_dbusmock
    from tests.test_repair_dbus import SystemdMock

    need_dbusmock()
    m = SystemdMock(tmp_path / "bus")
    try:
        m.start()
        monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", m.address)
        yield m
    finally:
        m.close()


@pytest.fixture
def subscribing_systemd(tmp_path, need_root):
    """systemd_mock plus the Subscribe the daemon's watcher calls."""
    from tests.test_repair_dbus import SystemdMock

    need_bus_parts()
    m = SystemdMock(tmp_path / "sdbus")
    try:
        m.start()
        m.accept_subscribe()
        yield m
    finally:
        m.close()


@pytest.fixture
def signal_bus(tmp_path, need_root):
    """systemd as the daemon's watcher needs it: Subscribe, and signals sent with EmitSignal (test_daemon_dbus's
    PrivateBus, its mock's connection as .conn)."""
    from tests.test_daemon_dbus import PrivateBus

    need_bus_parts()
    (tmp_path / "bus").mkdir()
    b = PrivateBus(tmp_path / "bus")
    b.start()
    try:
        b.conn = b.start_mock()
        yield b
    finally:
        b.close()


# -- cgroup2 device cgroups judged by the kernel ------------------------------------------------------
def cgroup2_dirs(label: str, free: int = 0):
    """bpfasm.CgroupDirs under the host's cgroup2 mount, once the kernel loads BPF_CGROUP_DEVICE programs;
    free: how many char majors without a driver the test needs (1: major 195 itself, 2: 195 and another), so
    that an allowed open says ENXIO. Skips (fails in CI) otherwise."""
    from nvsymlinkd.access import bpfeval, bpfprog
    from nvsymlinkd.access.cgroup import find_cgroup_mounts
    from nvsymlinkd.host.root import HostRoot
    from tests import bpfasm

    mounts = find_cgroup_mounts(HostRoot("/"))
    if mounts.v2 is None:
        skip_or_fail("needs a cgroup2 mount")
    try:
        os.close(bpfprog.load_device_program(bpfeval.encode(bpfasm.runc_allow_all())))
    except bpfprog.BpfError as e:
        skip_or_fail(f"kernel cannot load BPF_CGROUP_DEVICE programs: {e}")
    majors = bpfasm.free_majors("Character") if free else []
    if free >= 1 and 195 not in majors:
        skip_or_fail("char major 195 has a driver here: an allowed open would not say ENXIO")
    if free >= 2 and len(majors) < 2:
        skip_or_fail("needs char major 195 and another without a driver (an allowed open says ENXIO)")
    return bpfasm.CgroupDirs(mounts.v2.mountpoint, label)


@pytest.fixture
def v2(need_root):
    dirs = cgroup2_dirs("cache")
    yield dirs
    dirs.close()


@pytest.fixture
def v2_free195(need_root):
    """v2, with char major 195 free of a driver."""
    dirs = cgroup2_dirs("v2repair", free=1)
    yield dirs
    dirs.close()


@pytest.fixture
def v2_free2(need_root):
    """v2, with char major 195 and another free of a driver."""
    dirs = cgroup2_dirs("narrow", free=2)
    yield dirs
    dirs.close()


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
