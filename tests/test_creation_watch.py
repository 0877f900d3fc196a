"""The creation-time drop-in's wait (daemon.inotify.CreationWatch with systemd.scopes.wait_for_scope):
woken by systemd's transient drop-ins for the scope or the container's state file, never a poll (issue 38
item 2). systemd's files only (use_bus=False); the daemon's bus path: tests/test_daemon_containers.py."""

from __future__ import annotations

import os
import threading
import time

import pytest

from nvsymlinkd.containers.early import runtime_policy_set
from nvsymlinkd.daemon import inotify
from nvsymlinkd.host.root import HostRoot
from nvsymlinkd.systemd import scopes

SCOPE = "cri-containerd-" + "c7ea" * 16 + ".scope"
STATE = "/run/containerd/runc/k8s.io/" + "c7ea" * 16


def _host(tmp_path):
    (tmp_path / STATE.lstrip("/")).mkdir(parents=True)
    transient = tmp_path / scopes.TRANSIENT_DIR.lstrip("/")
    transient.mkdir(parents=True)
    (transient / SCOPE).write_text("[Scope]\nDelegate=yes\n")  # StartTransientUnit: no device properties
    return HostRoot(str(tmp_path)), transient


def _later(seconds, act):
    t = threading.Timer(seconds, act)
    t.start()
    return t


def test_the_transient_dir_is_the_one_systemd_writes_set_properties_to():
    assert inotify.TRANSIENT_DIR == scopes.TRANSIENT_DIR


def test_runc_set_wakes_the_wait_which_reads_twice(tmp_path):
    root, transient = _host(tmp_path)

    def runc_set():  # systemd's unit_write_setting: <unit>.d made, each file renamed in
        d = transient / f"{SCOPE}.d"
        d.mkdir()
        (d / ".#50-DevicePolicy.conf").write_text("[Scope]\nDevicePolicy=strict\n")
        (d / ".#50-DevicePolicy.conf").rename(d / "50-DevicePolicy.conf")

    wake = inotify.CreationWatch(root, SCOPE, STATE)
    t = _later(0.5, runc_set)
    try:
        start = time.monotonic()
        sd, reads = scopes.wait_for_scope(root, SCOPE, runtime_policy_set, 10.0, 0.01, use_bus=False, wake=wake)
        took = time.monotonic() - start
    finally:
        t.join()
        wake.close()
    assert sd is not None and sd.policy == "strict"
    # the first read, then one per wake, each wake one of runc_set's moments at most: the directory made (seen
    # from the transient dir), then, as far as the wait has watched the new directory by then, the file
    # created, written and renamed in: 2-4 wakes by the scheduling (a loaded CI machine saw 3), never a poll's
    # dozens (76 reads at 10 ms before)
    assert reads <= 5 and wake.wakes == reads - 1, (reads, wake.wakes)
    assert took < 10.0  # woken, not timed out (a missed event waits the whole timeout)


def test_the_state_file_landing_wakes_the_wait(tmp_path):
    root, _ = _host(tmp_path)
    state_json = tmp_path / STATE.lstrip("/") / "state.json"
    wake = inotify.CreationWatch(root, SCOPE, STATE)
    t = _later(0.3, lambda: state_json.write_text("{}"))
    try:
        sd, reads = scopes.wait_for_scope(root, SCOPE, lambda sd: state_json.exists(), 10.0, 0.01,
                                          use_bus=False, wake=wake)
    finally:
        t.join()
        wake.close()
    assert sd is not None and sd.policy == "auto" and state_json.exists()
    assert reads == 2 and wake.wakes == 1, (reads, wake.wakes)


def test_nothing_changing_is_one_read_and_the_timeout(tmp_path):
    root, _ = _host(tmp_path)
    wake = inotify.CreationWatch(root, SCOPE, STATE)
    try:
        sd, reads = scopes.wait_for_scope(root, SCOPE, runtime_policy_set, 0.3, 0.01, use_bus=False, wake=wake)
    finally:
        wake.close()
    assert sd is not None and sd.policy == "auto" and (reads, wake.wakes) == (2, 0), (reads, wake.wakes)


class _Variant:
    def __init__(self, value):
        self.value = value


def test_two_gets_straddling_runc_set_are_read_again(monkeypatch):
    """runc's Set is one SetUnitProperties (DevicePolicy=strict and its entries), applied whole; the wait's two
    pipelined Gets can still straddle it: DevicePolicy read before (auto), DeviceAllow after (runc's
    entries). Judged as read, `auto` with entries refused the drop-in (would_narrow): a benchmark's round
    in twenty lost its drop-in. Such a read is read again once."""
    import asyncio

    from nvsymlinkd.containers.early import runtime_policy_set
    from nvsymlinkd.systemd import client

    answers = iter([("auto", [("/dev/char/1:3", "rwm")]), ("strict", [("/dev/char/1:3", "rwm")])])
    current: list = []

    async def get_unit(bus, unit, timeout=None):
        return "/org/freedesktop/systemd1/unit/x"

    async def call(bus, member, signature="", body=(), **kw):
        if body[1] == "DevicePolicy":
            current[:] = next(answers)
            return [_Variant(current[0])]
        return [_Variant(current[1])]

    monkeypatch.setattr(client, "get_unit", get_unit)
    monkeypatch.setattr(client, "call", call)
    sd, reads = asyncio.run(scopes._poll_bus(None, SCOPE, runtime_policy_set, 5.0, 0.01))
    assert sd.policy == "strict" and reads == 2


def _set(transient, policy="strict", allow=("/dev/char/1:3 rwm",)):
    d = transient / f"{SCOPE}.d"
    d.mkdir(exist_ok=True)
    (d / "50-DevicePolicy.conf").write_text(f"[Scope]\nDevicePolicy={policy}\n")
    (d / "50-DeviceAllow.conf").write_text("[Scope]\nDeviceAllow=\n" + "".join(f"DeviceAllow={a}\n" for a in allow))
    return d


def test_systemds_files_say_runcs_set_without_the_bus(tmp_path):
    """The wait reads runc's Set where systemd stored it before answering it (issue 34, s29@v1): no bus."""
    root, transient = _host(tmp_path)
    _set(transient)
    sd = scopes.read_unit_files(root, SCOPE)
    assert sd is not None and sd.source == "files" and sd.policy == "strict"
    assert [str(e) for e in sd.entries] == ["/dev/char/1:3 rwm"]
    sd, reads = scopes.wait_for_scope(root, SCOPE, runtime_policy_set, 5.0, 0.01, use_bus=False)
    assert sd.policy == "strict" and reads == 1


@pytest.mark.parametrize("planted", ["dropin-dir-link", "dropin-dir-writable", "conf-link", "transient-link"])
def test_a_file_that_is_not_systemds_says_nothing(tmp_path, planted):
    """Read only through root's own directories, never through a link: a planted strict policy could make a
    drop-in narrow an unrestricted scope; the answer is then unknown (None), and nothing is written."""
    root, transient = _host(tmp_path)
    if planted == "dropin-dir-link":
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        (elsewhere / "50-DevicePolicy.conf").write_text("[Scope]\nDevicePolicy=strict\n")
        os.symlink(elsewhere, transient / f"{SCOPE}.d")
    elif planted == "dropin-dir-writable":
        os.chmod(_set(transient), 0o777)
    elif planted == "conf-link":
        d = _set(transient)
        (tmp_path / "policy.conf").write_text("[Scope]\nDevicePolicy=strict\n")
        (d / "50-DevicePolicy.conf").unlink()
        os.symlink(tmp_path / "policy.conf", d / "50-DevicePolicy.conf")
    else:
        (tmp_path / "unit").write_text("[Scope]\nDevicePolicy=strict\n")
        (transient / SCOPE).unlink()
        os.symlink(tmp_path / "unit", transient / SCOPE)
    assert scopes.read_unit_files(root, SCOPE) is None


def test_half_of_runcs_set_in_the_files_is_not_acted_on(tmp_path):
    """DeviceAllow's file without DevicePolicy's reads `auto` with entries: not runc's Set (it sends the
    policy first), and an entry of ours on an `auto` scope would narrow it: read again at the next wake."""
    root, transient = _host(tmp_path)
    d = transient / f"{SCOPE}.d"
    d.mkdir()
    (d / "50-DeviceAllow.conf").write_text("[Scope]\nDeviceAllow=\nDeviceAllow=/dev/char/1:3 rwm\n")
    wake = inotify.CreationWatch(root, SCOPE, STATE)
    t = _later(0.3, lambda: (d / "50-DevicePolicy.conf").write_text("[Scope]\nDevicePolicy=strict\n"))
    try:
        sd, reads = scopes.wait_for_scope(root, SCOPE, runtime_policy_set, 10.0, 0.01, use_bus=False, wake=wake)
    finally:
        t.join()
        wake.close()
    assert sd.policy == "strict" and reads >= 2
