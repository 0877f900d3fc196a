"""The daemon's verification cache (nvsymlinkd/verify/cache.py) against the uncached path as the oracle.

Real device cgroups (v1 devices.allow/deny, v2 BPF programs attached through bpf(2)) and runtime
files in the runtimes' own layouts: after every change, a pass with the kept VerifyCache must give
the very report (JSON, less the timing) a fresh pass gives, and the unchanged passes must have been
answered from the cache (or the test proves nothing).
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from nvsymlinkd.access import bpfeval, bpfprog
from nvsymlinkd.access.cgroup import find_cgroup_mounts
from nvsymlinkd.config import Config
from nvsymlinkd.containers import baseline as baselinemod
from nvsymlinkd.devchar.snapshot import read_majors
from nvsymlinkd.host.devices import Device, Rule
from nvsymlinkd.host.root import HostRoot
from nvsymlinkd.systemd import scopes as scopesmod
from nvsymlinkd.verify import cache as cachemod
from nvsymlinkd.verify.cache import VerifyCache
from nvsymlinkd.verify.verifier import verify_all
from tests import bpfasm
from tests.conftest import skip_or_fail, v1_cgroup
from tests.fixtures.runtimes.layouts import Layouts, oci_spec, spec_node, spec_rule

GPU_SPEC = oci_spec(rules=[spec_rule(195, 0), spec_rule(195, 255)], nodes=[spec_node("/dev/nvidia0", 195, 0)],
                    env=["NVIDIA_VISIBLE_DEVICES=0"])


def two_gpu_host(fakehost):
    fakehost.proc_devices({"nvidia-frontend": 195})
    fakehost.node("/dev/nvidia0", 195, 0)
    fakehost.node("/dev/nvidia1", 195, 1)
    fakehost.node("/dev/nvidiactl", 195, 255)
    fakehost.path("/sys/fs").mkdir(parents=True)
    os.symlink("/sys/fs/cgroup", fakehost.path("/sys/fs/cgroup"))
    return HostRoot(str(fakehost.root))


def _doc(report) -> dict:
    doc = report.to_json()
    doc.pop("seconds")
    return doc


class Oracle:
    """verify_all with the kept cache vs a fresh verify_all, after each step."""

    def __init__(self, root: HostRoot, cache: VerifyCache):
        self.root, self.cache, self.config = root, cache, Config()

    def check(self, what: str) -> dict:
        cached = _doc(verify_all(self.root, self.config, use_bus=False, with_host=False, cache=self.cache))
        fresh = _doc(verify_all(self.root, self.config, use_bus=False, with_host=False))
        assert cached == fresh, f"after {what}: the cached pass differs from a fresh one"
        return {c["id"]: c["verdict"] for c in fresh["containers"]}

    def unchanged(self, what: str) -> dict:
        verdicts = self.check(what)
        assert self.cache.verdict_hits > 0, f"after {what}: nothing came from the cache (the test proves nothing)"
        return verdicts


def _rewrite_same_size_keep_mtime(path, old: str, new: str) -> None:
    """Rewrite a file in place (same inode, same size) and put its mtime back: only ctime tells."""
    assert len(old) == len(new)
    st = os.stat(path)
    text = path.read_text()
    assert text.count(old) == 1
    with open(path, "r+") as f:
        f.write(text.replace(old, new))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)


def _replace_json(path, doc: dict) -> None:
    """The runtimes' way: a new file renamed over the old one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc))
    os.rename(tmp, path)


def test_cached_passes_judge_every_change_like_a_fresh_pass(fakehost, v1_parent):
    root = two_gpu_host(fakehost)
    lay = Layouts(fakehost)
    lay.containerd("ctrd1", GPU_SPEC, cgroup=v1_cgroup(v1_parent, "ctrd1", ["c 195:0 rw", "c 195:255 rw"]))
    lay.docker("dock1", GPU_SPEC, cgroup=v1_cgroup(v1_parent, "dock1", ["c 195:0 rw", "c 195:255 rw"]))
    runc_pid = lay.runc("runc1", GPU_SPEC, cgroup=v1_cgroup(v1_parent, "runc1", ["c 195:0 rw", "c 195:255 rw"]))
    lay.runc("hook1", GPU_SPEC, cgroup=v1_cgroup(v1_parent, "hook1", ["c 195:0 rw", "c 195:1 rw", "c 195:255 rw"]))
    crio_pid = lay.crio("crio1", GPU_SPEC)  # runc's state says systemd driver: its scope's DeviceAllow counts
    fakehost.write(f"/proc/{crio_pid}/cgroup", lay.v1_cgroup(v1_cgroup(v1_parent, "crio1", ["c 195:0 rw", "c 195:255 rw"])))
    unit = "/run/systemd/transient/crio-crio1.scope"
    fakehost.write(unit, "[Scope]\nDevicePolicy=strict\nDeviceAllow=/dev/char/195:0 rw\nDeviceAllow=char-nvidia-frontend rw\n")
    time.sleep(0.05)  # the files' ctime a tick behind the edits below, so ctime alone can tell them
    # every file counts as settled at once: identity (inode, size, mtime, ctime) is all that protects
    oracle = Oracle(root, VerifyCache(now_ns=lambda: time.time_ns() + 10 * 10**9))
    first = {"ctrd1": "ok", "dock1": "ok", "runc1": "ok", "hook1": "at-risk", "crio1": "ok"}
    assert oracle.check("the first pass") == first
    assert oracle.unchanged("nothing") == first

    # the scope's DeviceAllow loses the GPUs (the next daemon-reload would take them)
    fakehost.write(unit, "[Scope]\nDevicePolicy=strict\nDeviceAllow=/dev/char/195:9 rw\nDeviceAllow=char-pts rw\n")
    assert oracle.unchanged("a scope's DeviceAllow rewritten")["crio1"] == "at-risk"

    # devices.list changed: its mtime does not move when devices.deny is written
    v1 = fakehost.path("/sys/fs/cgroup/devices")
    list_file = v1 / v1_parent / "ctrd1" / "devices.list"
    mtime = os.stat(list_file).st_mtime_ns
    (v1 / v1_parent / "ctrd1" / "devices.deny").write_text("c 195:0 rw\n")
    assert os.stat(list_file).st_mtime_ns == mtime
    assert oracle.unchanged("a denied device")["ctrd1"] == "lost"

    # the spec rewritten in place, same size, mtime put back: it now asks for nvidia1, which is denied
    spec = fakehost.path("/run/containerd/io.containerd.runtime.v2.task/moby/dock1/config.json")
    _rewrite_same_size_keep_mtime(spec, '"minor": 0, "access"', '"minor": 1, "access"')
    assert oracle.unchanged("a spec rewritten in place")["dock1"] == "lost"

    # runc's state replaced (rename) with the hook's device among its recorded rules: declared now
    state_path = fakehost.path("/run/runc/hook1/state.json")
    state = json.loads(state_path.read_text())
    state["config"]["cgroups"]["devices"].append(
        {"type": 99, "major": 195, "minor": 1, "permissions": "rw", "allow": True})
    _replace_json(state_path, state)
    assert oracle.unchanged("a replaced state.json")["hook1"] == "ok"

    # a baseline appears (an input of the expected set): nvidia1 becomes expected of runc1, which lacks it
    baselinemod.record(root, Config(), "runc1", 1000, {Device.char(195, 1): "rw"})
    assert oracle.unchanged("a new baseline")["runc1"] == "lost"

    # the host gains nvidia-uvm (host nodes and majors are inputs too)
    fakehost.proc_devices({"nvidia-frontend": 195, "nvidia-uvm": 510})
    fakehost.node("/dev/nvidia-uvm", 510, 0)
    oracle.check("a new uvm node")  # every container's candidates change: nothing can come from the cache

    # the init process is gone (its pid now another process's): the container stopped
    stat_file = fakehost.path(f"/proc/{runc_pid}/stat")
    stat_file.write_text(stat_file.read_text().replace(" 1000 1000 100 ", " 2000 1000 100 "))
    assert oracle.unchanged("a reused pid")["runc1"] == "not-running"


def test_a_spec_rewritten_in_the_tick_it_was_read_is_read_again(fakehost, v1_parent, monkeypatch):
    """Same inode, size, mtime AND ctime (the coarse clock did not move): only the racy rule saves us."""
    root = two_gpu_host(fakehost)
    lay = Layouts(fakehost)
    lay.runc("runc1", GPU_SPEC, cgroup=v1_cgroup(v1_parent, "runc1", ["c 195:0 rw", "c 195:255 rw"]))
    spec = fakehost.path("/srv/bundles/runc1/config.json")
    oracle = Oracle(root, VerifyCache())
    for _ in range(20):  # within one clock tick of the last write, whatever this machine's load
        spec.write_text(json.dumps(GPU_SPEC))
        assert oracle.check("a fresh spec")["runc1"] == "ok"
        before = os.stat(spec)
        _rewrite_same_size_keep_mtime(spec, '"minor": 0, "access"', '"minor": 1, "access"')
        same_tick = os.stat(spec).st_ctime_ns == before.st_ctime_ns
        assert oracle.check("a spec rewritten at once")["runc1"] == "lost"
        if same_tick:
            return
    # Linux >= 6.13 stamps with fine-grained timestamps: no rewrite shares the read's tick, and each of
    # the 20 above was still noticed; the coarse-clock test below makes the same-tick case certain.


def test_a_spec_rewritten_on_a_coarse_clock_filesystem_is_read_again(fakehost, v1_parent, monkeypatch):
    """The same, made certain: fstat shows the rewritten spec with the stamps of the first write."""
    root = two_gpu_host(fakehost)
    Layouts(fakehost).runc("runc1", GPU_SPEC, cgroup=v1_cgroup(v1_parent, "runc1", ["c 195:0 rw", "c 195:255 rw"]))
    spec = fakehost.path("/srv/bundles/runc1/config.json")
    first = os.stat(spec)
    real_fstat = os.fstat

    def coarse_fstat(fd):
        st = real_fstat(fd)
        if st.st_ino != first.st_ino:
            return st
        fields = list(st)
        fields[8] = fields[9] = int(first.st_mtime)  # st_mtime, st_ctime
        return os.stat_result(fields, {"st_mtime_ns": first.st_mtime_ns, "st_ctime_ns": first.st_ctime_ns,
                                       "st_atime_ns": st.st_atime_ns})

    monkeypatch.setattr(cachemod.os, "fstat", coarse_fstat)
    oracle = Oracle(root, VerifyCache(now_ns=lambda: first.st_ctime_ns))  # read in the tick of the write
    assert oracle.check("a fresh spec")["runc1"] == "ok"
    _rewrite_same_size_keep_mtime(spec, '"minor": 0, "access"', '"minor": 1, "access"')
    assert oracle.check("a spec rewritten in the same tick")["runc1"] == "lost"


class Program:
    """One device program attached to a cgroup2 directory; replace() swaps it like runc update does."""

    def __init__(self, cgroup_dir: str, rules: list):
        self.cg_fd = bpfprog.open_cgroup_dir(cgroup_dir)
        self.prog_fd = None
        self.replace(rules)

    def replace(self, rules: list) -> None:
        new = bpfprog.load_device_program(bpfeval.encode(bpfasm.runc_program(rules, default_allow=False)))
        bpfprog.attach_device_program(self.cg_fd, new, bpfprog.BPF_F_ALLOW_MULTI)
        self.detach()
        self.prog_fd = new

    def detach(self) -> None:
        if self.prog_fd is not None:
            bpfprog.detach_device_program(self.cg_fd, self.prog_fd)
            os.close(self.prog_fd)
            self.prog_fd = None

    def close(self) -> None:
        self.detach()
        os.close(self.cg_fd)


def test_a_replaced_bpf_program_is_judged_again(fakehost, v2):
    root = two_gpu_host(fakehost)
    if find_cgroup_mounts(root).v2 is None and not os.path.exists(fakehost.path("/sys/fs/cgroup/cgroup.controllers")) \
            and not os.path.exists(fakehost.path("/sys/fs/cgroup/unified/cgroup.controllers")):
        skip_or_fail("the cgroup2 mount is not at /sys/fs/cgroup or /sys/fs/cgroup/unified")
    lay = Layouts(fakehost)
    grant = [Rule(True, "c", 195, 0, "rw"), Rule(True, "c", 195, 255, "rw")]
    progs = []
    try:
        for cid in ("v2ctr", "steady"):
            cgroup = v2.make(cid)
            pid = lay.containerd(cid, GPU_SPEC, cgroup=cgroup)
            fakehost.write(f"/proc/{pid}/cgroup", Layouts.v2_cgroup(cgroup))  # v2 only: the program decides
            progs.append(Program(v2.real(cgroup), grant))
        prog = progs[0]
        time.sleep(0.06)
        oracle = Oracle(root, VerifyCache())
        assert oracle.check("the first pass") == {"v2ctr": "ok", "steady": "ok"}
        assert oracle.unchanged("nothing") == {"v2ctr": "ok", "steady": "ok"}
        prog.replace(grant[1:])  # nvidia0 gone: a new program, a new id
        assert oracle.unchanged("a replaced program")["v2ctr"] == "lost"
        prog.replace(grant)  # the same instructions as the first, again a new program
        assert oracle.unchanged("the grant back")["v2ctr"] == "ok"
        prog.detach()  # no program at all: no v2 restriction
        oracle.unchanged("the program detached")
    finally:
        for p in progs:
            p.close()


def test_a_wall_clock_step_back_drops_the_kept_files(fakehost, v1_parent):
    root = two_gpu_host(fakehost)
    Layouts(fakehost).runc("runc1", GPU_SPEC, cgroup=v1_cgroup(v1_parent, "runc1", ["c 195:0 rw", "c 195:255 rw"]))
    offset = [0]
    cache = VerifyCache(now_ns=lambda: time.time_ns() + 10 * 10**9, clock_offset=lambda: offset[0])
    verify_all(root, Config(), use_bus=False, with_host=False, cache=cache)
    verify_all(root, Config(), use_bus=False, with_host=False, cache=cache)
    assert cache.files.hits > 0
    offset[0] -= cachemod.RACY_NS  # the wall clock stepped back by 50 ms against the monotonic one
    hits = cache.files.hits
    verify_all(root, Config(), use_bus=False, with_host=False, cache=cache)
    assert cache.files.hits == hits, "files kept before the step were trusted after it"


# --- the host's nodes and the absent baselines: kept while their directories are unchanged -------

CAP_SPEC = oci_spec(rules=[spec_rule(195, 0), spec_rule(195, 255)], nodes=[spec_node("/dev/nvidia0", 195, 0)],
                    env=["NVIDIA_VISIBLE_DEVICES=0"])


def _mig_host(fakehost):
    root = two_gpu_host(fakehost)
    fakehost.proc_devices({"nvidia-frontend": 195, "nvidia-caps": 509})
    for minor in (1, 2):
        fakehost.node(f"/dev/nvidia-caps/nvidia-cap{minor}", 509, minor)
    return root


def _counting_scans(monkeypatch) -> list:
    calls = []
    real = cachemod.scan_nodes

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cachemod, "scan_nodes", counted)
    return calls


def test_host_nodes_are_scanned_again_when_a_node_directory_changes(fakehost, v1_parent, monkeypatch):
    """The container's cgroup grants the caps: which of them the host has shows in its report
    (`granted`), so a node made, removed, re-made with another rdev, or a nvidia-caps directory
    swapped for a link must show in the cached pass exactly as in a fresh one."""
    root = _mig_host(fakehost)
    Layouts(fakehost).runc("runc1", CAP_SPEC, cgroup=v1_cgroup(
        v1_parent, "runc1", ["c 195:0 rw", "c 195:255 rw", "c 509:* r"]))
    time.sleep(0.05)  # the directories' ctime a tick behind the changes below
    scans = _counting_scans(monkeypatch)
    oracle = Oracle(root, VerifyCache(now_ns=lambda: time.time_ns() + 10 * 10**9))
    caps = fakehost.path("/dev/nvidia-caps")

    def granted(what: str) -> list:
        oracle.check(what)
        report = verify_all(root, Config(), use_bus=False, with_host=False, cache=oracle.cache)
        return sorted(str(k) for k in report.containers[0].granted if k.major == 509)

    assert granted("the first pass") == ["c 509:1", "c 509:2"]
    before = len(scans)
    assert granted("nothing") == ["c 509:1", "c 509:2"]
    assert len(scans) == before, "an unchanged host was scanned again (the test proves nothing)"
    fakehost.node("/dev/nvidia-caps/nvidia-cap3", 509, 3)
    assert granted("a node made") == ["c 509:1", "c 509:2", "c 509:3"]
    time.sleep(0.02)
    os.unlink(caps / "nvidia-cap1")
    assert granted("a node removed") == ["c 509:2", "c 509:3"]
    time.sleep(0.02)
    os.unlink(caps / "nvidia-cap2")
    fakehost.node("/dev/nvidia-caps/nvidia-cap2", 509, 7)  # the same name, another rdev
    assert granted("a name re-made") == ["c 509:3", "c 509:7"]
    time.sleep(0.02)
    os.rename(caps, fakehost.path("/dev/caps-real"))
    os.symlink("caps-real", caps)  # never scanned through a link
    assert granted("nvidia-caps swapped for a link") == []
    time.sleep(0.02)
    fakehost.proc_devices({"nvidia-frontend": 195})
    assert granted("the caps major gone") == []


def test_host_nodes_changed_in_the_tick_of_the_stamps_are_scanned_again(fakehost, monkeypatch):
    """Directories whose ctime is the moment of the read (a change in the same clock tick keeps the
    same stamps) are never trusted: the scan runs again, and a node made meanwhile is seen."""
    root = _mig_host(fakehost)
    cache = VerifyCache()
    frozen = cachemod._node_dir_stamps(root, "/dev")
    monkeypatch.setattr(cachemod, "_node_dir_stamps", lambda root, base: frozen)
    cache.files._now_ns = lambda: frozen[0][3]  # read in the tick of the last change
    majors = read_majors(root)
    assert [n.minor for n in cache.host_nodes(root, "/", majors) if n.major == 509] == [1, 2]
    fakehost.node("/dev/nvidia-caps/nvidia-cap3", 509, 3)  # the stamps (frozen) do not show it
    assert [n.minor for n in cache.host_nodes(root, "/", majors) if n.major == 509] == [1, 2, 3]


def test_absent_baselines_are_listed_again_when_their_directory_changes(fakehost, v1_parent, monkeypatch):
    root = two_gpu_host(fakehost)
    Layouts(fakehost).runc("runc1", GPU_SPEC, cgroup=v1_cgroup(v1_parent, "runc1", ["c 195:0 rw", "c 195:255 rw"]))
    Layouts(fakehost).runc("runc2", GPU_SPEC, cgroup=v1_cgroup(v1_parent, "runc2", ["c 195:0 rw", "c 195:255 rw"]))
    baselinemod.record(root, Config(), "runc2", 1000, {Device.char(195, 0): "rw"})
    time.sleep(0.05)
    opened = []
    real_load = baselinemod.load

    def counted(root, config, container_id, *args, **kwargs):
        opened.append(container_id)
        return real_load(root, config, container_id, *args, **kwargs)

    monkeypatch.setattr(baselinemod, "load", counted)
    oracle = Oracle(root, VerifyCache(now_ns=lambda: time.time_ns() + 10 * 10**9))
    oracle.check("the first pass")
    opened.clear()
    verify_all(root, Config(), use_bus=False, with_host=False, cache=oracle.cache)
    assert opened == ["runc2"], "a container without a baseline had its file opened (or one with it not)"
    # a baseline appears: nvidia1 becomes expected of runc1, which lacks it
    baselinemod.record(root, Config(), "runc1", 1000, {Device.char(195, 1): "rw"})
    assert oracle.unchanged("a new baseline")["runc1"] == "lost"
    time.sleep(0.02)
    os.unlink(root.path(baselinemod.baseline_path(Config(), "runc1")))
    assert oracle.unchanged("the baseline removed")["runc1"] == "ok"


def test_a_baseline_made_in_the_tick_of_the_listing_is_seen(fakehost, monkeypatch):
    """The directory shows the stamps it had when listed (a change in the same coarse clock tick):
    only the racy rule makes the new baseline seen."""
    root = two_gpu_host(fakehost)
    baselinemod.record(root, Config(), "other", 1000, {Device.char(195, 0): "rw"})  # the directory exists
    directory = root.path(baselinemod.baseline_dir(Config()))
    first = os.stat(directory)
    files = cachemod.FileCache(now_ns=lambda: first.st_ctime_ns)  # read in the tick of the last change
    path = root.path(baselinemod.baseline_path(Config(), "runc1"))
    assert files.absent(path)
    files.end_pass()
    baselinemod.record(root, Config(), "runc1", 1000, {Device.char(195, 1): "rw"})
    real_stat = os.stat
    monkeypatch.setattr(cachemod.os, "stat", lambda p, *a, **k: first if p == directory else real_stat(p, *a, **k))
    assert not files.absent(path)


def test_a_baseline_directory_made_between_passes_is_seen(fakehost):
    root = two_gpu_host(fakehost)
    path = root.path(baselinemod.baseline_path(Config(), "runc1"))
    files = cachemod.FileCache(now_ns=lambda: time.time_ns() + 10 * 10**9)
    assert files.absent(path)  # no directory at all: no baseline
    files.end_pass()
    baselinemod.record(root, Config(), "runc1", 1000, {Device.char(195, 1): "rw"})
    assert not files.absent(path)


def test_scope_unit_files_are_parsed_again_only_when_they_change(fakehost, v1_parent, monkeypatch):
    """The scope's transient unit and its system.control drop-ins (systemd's DeviceAllow without a bus):
    kept by identity, the drop-in directory by its stamps; every change below is still seen."""
    root = two_gpu_host(fakehost)
    lay = Layouts(fakehost)
    pid = lay.crio("crio1", GPU_SPEC)  # runc's state says systemd driver: its scope's DeviceAllow counts
    fakehost.write(f"/proc/{pid}/cgroup", lay.v1_cgroup(v1_cgroup(v1_parent, "crio1", ["c 195:0 rw", "c 195:255 rw"])))
    lay.runc("runc1", GPU_SPEC, cgroup=v1_cgroup(v1_parent, "runc1", ["c 195:0 rw", "c 195:255 rw"]))  # unchanged
    unit = "/run/systemd/transient/crio-crio1.scope"
    fakehost.write(unit, "[Scope]\nDevicePolicy=strict\nDeviceAllow=/dev/char/195:0 rw\nDeviceAllow=char-nvidia-frontend rw\n")
    dropins = fakehost.path("/run/systemd/system.control/crio-crio1.scope.d")
    parsed: list = []
    real_settings = scopesmod.unit_settings

    def counted(text):
        parsed.append(text)
        return real_settings(text)

    monkeypatch.setattr(scopesmod, "unit_settings", counted)
    time.sleep(0.05)
    oracle = Oracle(root, VerifyCache(now_ns=lambda: time.time_ns() + 10 * 10**9))
    assert oracle.check("the first pass")["crio1"] == "ok"
    verify_all(root, Config(), use_bus=False, with_host=False, cache=oracle.cache)
    parsed.clear()
    assert oracle.unchanged("nothing")["crio1"] == "ok"
    assert len(parsed) == 1, "the cached pass parsed the unchanged unit file again (or the fresh one did not)"

    # a drop-in appears (systemctl set-property --runtime): DeviceAllow= resets the list, no GPU left
    dropins.mkdir(parents=True)
    (dropins / "50-DeviceAllow.conf").write_text("[Scope]\nDeviceAllow=\nDeviceAllow=char-pts rw\n")
    assert oracle.unchanged("a drop-in added")["crio1"] == "at-risk"
    listed: list = []
    real_listdir = os.listdir
    monkeypatch.setattr(os, "listdir", lambda path=".": listed.append(str(path)) or real_listdir(path))
    verify_all(root, Config(), use_bus=False, with_host=False, cache=oracle.cache)
    assert str(dropins) not in listed, "the cached pass listed the unchanged drop-in directory again"
    # the drop-in rewritten in place, same size, mtime put back: the GPUs are back
    _rewrite_same_size_keep_mtime(dropins / "50-DeviceAllow.conf", "DeviceAllow=\nDeviceAllow=char-pts rw",
                                  "DeviceAllow=char-nvidia-frontend rwm")
    assert oracle.unchanged("a drop-in rewritten in place")["crio1"] == "ok"
    # a second drop-in sorting after it takes them again
    (dropins / "60-more.conf").write_text("[Scope]\nDeviceAllow=\n")
    assert oracle.unchanged("a second drop-in")["crio1"] == "at-risk"
    os.unlink(dropins / "60-more.conf")
    assert oracle.unchanged("a drop-in removed")["crio1"] == "ok"
    # the unit file itself rewritten in place, same size, mtime put back (only ctime tells)
    _rewrite_same_size_keep_mtime(fakehost.path(unit), "195:0 rw\nDeviceAllow=char-nvidia-frontend",
                                  "195:9 rw\nDeviceAllow=char-nvidia-frontenX")
    (dropins / "50-DeviceAllow.conf").unlink()
    assert oracle.unchanged("the unit rewritten in place")["crio1"] == "at-risk"


# --- the daemon: its kept cache still sees a change no runtime file shows ------------------------

from tests.test_daemon_containers import gpu0, start_daemon  # noqa: E402, F401 - start_daemon is a fixture


def test_daemon_sees_a_device_cgroup_change_between_cached_passes(runc_host, signal_bus, start_daemon):  # noqa: F811
    c = runc_host.run("gpu-cached", **gpu0())
    d = start_daemon(signal_bus, "--resync-interval", "1", config_text='repair = "report"\n')
    d.wait_until(lambda: d.passes("periodic resync") >= 2, "two periodic verifications (the cache filled)")
    assert not d.entries(kind="container-lost"), d.output()
    mark = d.mark()
    c.deny("c 195:0 rw")  # devices.list changes; no runtime file, no event, only the next periodic pass
    d.wait_entry("container-lost", c.id, mark)
    mark = d.mark()
    c.allow("c 195:0 rw")
    message, _ = d.wait_entry("container-ok", c.id, mark)
    assert "can open all its GPU devices again" in message


@pytest.mark.parametrize("cached", [False, True])
def test_the_pass_that_records_a_baseline_judges_as_the_next_one_will(fakehost, v1_parent, cached):
    """A hook-granted container seen for the first time: the daemon's pass records its baseline and
    judges it on that baseline in the same pass (what the hook granted is expected, so at risk now),
    not a pass later that a daemon-reload may come before (chaos soak, seed 38)."""
    root = two_gpu_host(fakehost)
    Layouts(fakehost).runc("hook2", GPU_SPEC,
                           cgroup=v1_cgroup(v1_parent, "hook2", ["c 195:0 rw", "c 195:1 rw", "c 195:255 rw"]))
    cache = VerifyCache() if cached else None
    config = Config()
    first = verify_all(root, config, update_baseline=True, use_bus=False, with_host=False, cache=cache)
    (c,) = first.containers
    assert c.baseline == "recorded"
    assert c.expected[Device.char(195, 1)].sources == ("baseline",), c.expected
    later = verify_all(root, config, update_baseline=True, use_bus=False, with_host=False, cache=cache)
    (d,) = later.containers
    assert d.baseline == "loaded"
    assert {**_doc(first)["containers"][0], "baseline": None} == {**_doc(later)["containers"][0], "baseline": None}
    assert c.verdict == "at-risk" and any(f.devices == (Device.char(195, 1),) for f in c.findings), c.findings


def test_a_pass_over_some_containers_keeps_the_others_cached(fakehost, v1_parent):
    """The daemon's pass for the containers whose runtime state was just written (only=...) must not
    drop what the others' verdicts are cached by: the next full pass still finds them unchanged."""
    root = two_gpu_host(fakehost)
    lay = Layouts(fakehost)
    for cid in ("one", "two"):
        lay.runc(cid, GPU_SPEC, cgroup=v1_cgroup(v1_parent, cid, ["c 195:0 rw", "c 195:255 rw"]))
    time.sleep(0.05)
    cache = VerifyCache(now_ns=lambda: time.time_ns() + 10 * 10**9)  # every file settled at once
    config = Config()
    verify_all(root, config, use_bus=False, with_host=False, cache=cache)
    partial = verify_all(root, config, use_bus=False, with_host=False, cache=cache, only=frozenset({"one"}))
    assert [c.id for c in partial.containers] == ["one"]
    full = verify_all(root, config, use_bus=False, with_host=False, cache=cache)
    assert {c.id: c.verdict for c in full.containers} == {"one": "ok", "two": "ok"}
    assert cache.verdict_hits == 2, "the container left out of the partial pass was judged afresh"


@pytest.fixture
def coarse_fs(tmp_path, need_root):
    """ext4 with 128-byte inodes: whole-second timestamps (no room for the nanoseconds)."""
    from tests.conftest import need_tool

    mkfs = need_tool("mkfs.ext4")
    image, mnt = tmp_path / "ext4-128.img", tmp_path / "mnt"
    with open(image, "wb") as f:
        f.truncate(16 << 20)
    subprocess.run([mkfs, "-q", "-F", "-I", "128", str(image)], check=True, capture_output=True)
    mnt.mkdir()
    subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=True, capture_output=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_verify_cache_sees_a_same_size_rewrite_within_the_second_on_coarse_timestamps(coarse_fs):
    import json

    from nvsymlinkd.verify.cache import FileCache

    path = str(coarse_fs / "config.json")
    for _ in range(3):
        time.sleep(1 - time.time() % 1 + 0.01)  # just after a second boundary
        with open(path, "w") as f:
            f.write(json.dumps({"v": "a"}))
        assert os.stat(path).st_ctime_ns % 1_000_000_000 == 0  # the filesystem keeps seconds only
        cache = FileCache()
        time.sleep(0.1)  # older than the fine-clock racy window
        assert cache.load(path) == {"v": "a"}
        with open(path, "r+") as f:  # in place, same size, same second: every stamp as it was
            f.write(json.dumps({"v": "b"}))
        assert cache.load(path) == {"v": "b"}
