"""A private system-like D-Bus for tests: a real dbus-daemon on its own socket, python-dbusmock as systemd.

    bus = start_bus(tmp_path)                 # dbus-daemon, returns BusDaemon (address, proc)
    mock = start_mock(bus.address, template)  # python -m dbusmock --system -t TEMPLATE, waits for the name
    with mock_bus(tmp_path, TEXT) as bus:     # both, stopped on the way out
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import IN_CI, need_tool

SYSTEMD = "org.freedesktop.systemd1"
SYSTEMD_PATH = "/org/freedesktop/systemd1"
MANAGER = "org.freedesktop.systemd1.Manager"
MOCK_IFACE = "org.freedesktop.DBus.Mock"
DEADLINE = 20.0
# how a dbusmock template names the mock: systemd's bus name, its object and the Manager interface
TEMPLATE_HEAD = f"""
BUS_NAME = {SYSTEMD!r}
MAIN_OBJ = {SYSTEMD_PATH!r}
MAIN_IFACE = {MANAGER!r}
SYSTEM_BUS = True
"""

# A bus that allows everything, shaped like the system bus (its own socket, EXTERNAL auth).
BUS_CONFIG = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>system</type>
  <listen>unix:path={socket}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <allow own="*"/>
    <allow send_destination="*" eavesdrop="true"/>
    <allow receive_sender="*"/>
    <allow send_type="signal"/>
    <allow send_type="method_call"/>
  </policy>
</busconfig>
"""


def need_dbusmock() -> None:
    need_tool("dbus-daemon")
    try:
        import dbus  # noqa: F401  (python3-dbus, dbusmock's own dependency)
        import dbusmock  # noqa: F401
    except ImportError as exc:
        if IN_CI:
            pytest.fail(f"CI must run this test, but: {exc} (python3-dbusmock)", pytrace=False)
        pytest.skip(f"python-dbusmock: {exc}")


@dataclass
class BusDaemon:
    socket: str
    address: str
    proc: subprocess.Popen

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout and not self.proc.stdout.closed:
            self.proc.stdout.close()


def start_bus(directory) -> BusDaemon:
    """Start dbus-daemon with BUS_CONFIG on DIRECTORY/system_bus_socket; returns once it listens."""
    socket = os.path.join(str(directory), "system_bus_socket")
    config = os.path.join(str(directory), "bus.conf")
    with open(config, "w") as f:
        f.write(BUS_CONFIG.format(socket=socket))
    proc = subprocess.Popen([need_tool("dbus-daemon"), f"--config-file={config}", "--nofork", "--nopidfile",
                             "--print-address=1"], stdout=subprocess.PIPE, text=True)
    printed = proc.stdout.readline().strip()
    assert printed.startswith("unix:path="), printed
    return BusDaemon(socket, f"unix:path={socket}", proc)


def start_mock(address: str, template_path, name: str = SYSTEMD) -> subprocess.Popen:
    """Run python-dbusmock with TEMPLATE on the bus at ADDRESS; returns once it owns NAME."""
    import dbus

    env = dict(os.environ, DBUS_SYSTEM_BUS_ADDRESS=address)
    mock = subprocess.Popen([sys.executable, "-m", "dbusmock", "--system", "-t", str(template_path)],
                            env=env, stdout=subprocess.DEVNULL)
    conn = dbus.bus.BusConnection(address)
    end = time.monotonic() + DEADLINE
    try:
        while not conn.name_has_owner(name):
            assert mock.poll() is None, "dbusmock exited"
            assert time.monotonic() < end, f"dbusmock never owned {name}"
            time.sleep(0.05)
    finally:
        conn.close()
    return mock


@contextlib.contextmanager
def mock_bus(directory, template: str, filename: str = "fake_systemd.py"):
    """A private bus with python-dbusmock running the template TEXT (written to DIRECTORY/FILENAME; `{bus_pid}`
    in it is the bus daemon's pid) as systemd; yields the BusDaemon, and stops both on the way out."""
    need_dbusmock()
    bus = start_bus(directory)
    mock = None
    try:
        path = Path(directory) / filename
        path.write_text(template.replace("{bus_pid}", str(bus.proc.pid)))
        mock = start_mock(bus.address, path)
        yield bus
    finally:
        if mock is not None:
            mock.kill()
            mock.wait()
        bus.kill()
