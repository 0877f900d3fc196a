"""Hostile or broken runtime and /proc files, through the CLI as an operator meets them.

A GPU container whose files cannot be read is reported `unknown` with the reason (never dropped as
"not a GPU container", never "not-running" by guess); one hostile file costs only its own container;
no input of any size or shape gives a traceback.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import v1_cgroup
from tests.fixtures.runtimes.layouts import Layouts, oci_spec, spec_rule

CID = "lost1"
DEEP = 200_000


GPU_SPEC = oci_spec(rules=[spec_rule(195, 0), spec_rule(195, 1), spec_rule(195, 255)],
                    env=["NVIDIA_VISIBLE_DEVICES=0,1"])


class LostHost:
    """A fake root with one GPU container (plain runc or containerd) that has lost c 195:1."""

    def __init__(self, fakehost, parent: str, runtime: str = "runc"):
        self.host = fakehost
        fakehost.proc_devices({"nvidia-frontend": 195, "nvidia-uvm": 510})
        for minor in (0, 1, 255):
            fakehost.node(f"/dev/nvidia{minor}" if minor != 255 else "/dev/nvidiactl", 195, minor)
        fakehost.path("/sys/fs").mkdir(parents=True, exist_ok=True)
        os.symlink("/sys/fs/cgroup", fakehost.path("/sys/fs/cgroup"))
        cgroup = v1_cgroup(parent, CID, ["c 195:0 rw", "c 195:255 rw"])
        lay = Layouts(fakehost)
        if runtime == "runc":
            lay.runc(CID, GPU_SPEC, cgroup=cgroup)
            self.spec = f"/srv/bundles/{CID}/config.json"
            self.state = f"/run/runc/{CID}/state.json"
        else:  # containerd whose runc root is not where we look: the spec is all there is
            lay.containerd(CID, GPU_SPEC, cgroup=cgroup, state=runtime != "containerd-spec-only")
            self.spec = f"/run/containerd/io.containerd.runtime.v2.task/k8s.io/{CID}/config.json"
            self.state = f"/run/containerd/runc/k8s.io/{CID}/state.json"

    @property
    def root(self) -> str:
        return str(self.host.root)

    def doc(self, inside: str) -> dict:
        return json.loads(self.host.path(inside).read_text())

    def put(self, inside: str, text: str) -> None:
        p = self.host.path(inside)
        if p.is_symlink() or p.exists():
            p.unlink()
        p.write_text(text)


def check(cli, root: str):
    proc = cli("--root", root, "check", "--no-host", "--json", "--no-bus")
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, json.loads(proc.stdout) if proc.stdout.strip() else None


@pytest.fixture(params=["runc", "containerd-spec-only"])
def lost_host(fakehost, v1_parent, request):
    return LostHost(fakehost, v1_parent, request.param)


def test_readable_lost_container_is_lost(lost_host, nvsymlinkd_cli):
    rc, doc = check(nvsymlinkd_cli, lost_host.root)
    assert rc == 1 and doc["summary"]["gpu_containers"] == 1
    assert doc["containers"][0]["verdict"] == "lost"


def _symlink_to_itself(h: LostHost, inside: str) -> None:
    # the same content, behind a symlink (O_NOFOLLOW refuses it)
    p = h.host.path(inside)
    copy = p.with_name("real-config.json")
    p.rename(copy)
    os.symlink(copy.name, p)


SPEC_BREAKAGE = {
    "symlink": _symlink_to_itself,
    "17MB": lambda h, f: h.put(f, json.dumps(dict(h.doc(f), pad="x" * (17 << 20)))),
    "array": lambda h, f: h.put(f, json.dumps([h.doc(f)])),
    "env-string": lambda h, f: h.put(f, json.dumps(dict(h.doc(f), process=dict(h.doc(f)["process"],
                                                                             env="NVIDIA_VISIBLE_DEVICES=0")))),
    "deep": lambda h, f: h.put(f, '{"a":' + "[" * DEEP + "]" * DEEP + "}"),
    "rule-major-string": lambda h, f: h.put(f, json.dumps(oci_spec(
        rules=[spec_rule(195, 0), spec_rule("195", 1), spec_rule(195, 255)], env=["NVIDIA_VISIBLE_DEVICES=0,1"]))),
}


@pytest.mark.parametrize("how", sorted(SPEC_BREAKAGE))
def test_unreadable_spec_is_unknown_never_dropped(lost_host, nvsymlinkd_cli, how):
    SPEC_BREAKAGE[how](lost_host, lost_host.spec)
    rc, doc = check(nvsymlinkd_cli, lost_host.root)
    assert rc == 1, doc
    assert doc["summary"]["gpu_containers"] == 1 and doc["ok"] is False
    c = doc["containers"][0]
    assert c["verdict"] in ("unknown", "lost"), c
    unknown = [f for f in c["findings"] if f["kind"] == "unknown"]
    assert unknown and lost_host.spec in unknown[0]["detail"], c


def _state_with(**changes):
    def change(h: LostHost, f: str) -> None:
        h.put(f, json.dumps(dict(h.doc(f), **changes)))
    return change


STATE_BREAKAGE = {
    "pid-string": lambda h, f: h.put(f, h.host.path(f).read_text().replace('"init_process_pid": ', '"init_process_pid": "', 1)
                                     .replace(', "init_process_start"', '", "init_process_start"', 1)),
    "pid-1e400": lambda h, f: h.put(f, h.host.path(f).read_text().replace('"init_process_pid": ', '"init_process_pid": 1e400, "x": ', 1)),
    "pid-bool": _state_with(init_process_pid=True),
    "deep": lambda h, f: h.put(f, '{"a":' + "[" * DEEP + "]" * DEEP + "}"),
    "rule-type-list": lambda h, f: h.put(f, json.dumps(dict(h.doc(f), config=dict(h.doc(f)["config"], cgroups=dict(
        h.doc(f)["config"]["cgroups"], devices=[{"type": [99], "major": 195, "minor": 1, "permissions": "rw",
                                                  "allow": True}]))))),
}


@pytest.mark.parametrize("how", sorted(STATE_BREAKAGE))
def test_unreadable_runc_state_is_unknown_not_stopped(fakehost, v1_parent, nvsymlinkd_cli, how):
    lost_host = LostHost(fakehost, v1_parent, "runc")
    STATE_BREAKAGE[how](lost_host, lost_host.state)
    rc, doc = check(nvsymlinkd_cli, lost_host.root)
    assert rc == 1, doc
    assert doc["summary"]["gpu_containers"] == 1
    c = doc["containers"][0]
    assert c["verdict"] in ("unknown", "lost"), c
    unknown = [f for f in c["findings"] if f["kind"] == "unknown"]
    assert unknown and lost_host.state in unknown[0]["detail"], c


# --- the JSON parsers on any shape: a result or ValueError, nothing else ------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from nvsymlinkd.containers.ocispec import (  # noqa: E402
    loads_object,
    parse_crun_status,
    parse_runc_state,
    parse_spec,
)

SCALARS = (st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.sampled_from([-1, 1e400]) | st.integers(4400, 5000).map(lambda n: 10 ** n)
           | st.floats(allow_nan=False) | st.text(max_size=20) | st.sampled_from(["c", "a", "rw", "195", "bundle=/x"]))
KEYS = st.sampled_from(["linux", "resources", "devices", "process", "env", "annotations", "hooks", "prestart",
                        "path", "root", "cgroupsPath", "allow", "type", "major", "minor", "access", "permissions",
                        "config", "cgroups", "Systemd", "Hooks", "labels", "cgroup_paths", "init_process_pid",
                        "init_process_start", "pid", "process-start-time", "scope", "name", "scope_prefix",
                        "cgroup-path", "bundle", "systemd-cgroup", "cdi.k8s.io/x"])
SHAPES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=6),
                      max_leaves=40)


@settings(max_examples=600, deadline=None)
@given(st.dictionaries(KEYS, SHAPES, max_size=8))
def test_json_parsers_raise_only_valueerror(doc):
    for parse in (parse_spec, parse_runc_state, parse_crun_status):
        try:
            parse(doc)
        except ValueError:
            pass


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["[", "{\"a\":", "[{\"b\":[", "[1,"]), st.integers(1, 300_000), st.booleans())
def test_deep_or_odd_json_text_is_a_valueerror(opening, depth, closed):
    text = opening * depth + ("" if not closed else "]" * depth)
    with pytest.raises(ValueError):
        loads_object(text)


def test_huge_numbers_in_json_text_are_a_valueerror_or_refused():
    for text in ('{"init_process_pid": ' + "9" * 5000 + "}", '{"init_process_pid": 1e400}',
                 '{"init_process_pid": "1"}', '{"init_process_pid": true}', '{"init_process_pid": 1.0}'):
        with pytest.raises(ValueError):
            parse_runc_state(loads_object(text))


# --- integers of thousands of digits ----------------------------------------------------------

HUGE = "1" * 5000


def test_proc_devices_nvidia_major_of_thousands_of_digits_is_one_clean_line(fakehost, nvsymlinkd_cli):
    from tests.fakehost import standard_host

    host = standard_host(fakehost.root)
    text = host.path("/proc/devices").read_text().replace("Character devices:\n",
                                                          f"Character devices:\n{HUGE} nvidia-uvm\n")
    host.write("/proc/devices", text)
    for argv in (["sync"], ["sync", "--dry-run"], ["check", "--no-host", "--no-bus"], ["repair", "--dry-run"]):
        proc = nvsymlinkd_cli("--root", host.root, *argv)
        assert proc.returncode == 2, (argv, proc.stderr)
        assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith("nvsymlinkd: /proc/devices:2: major '111111111"), proc.stderr
    assert host.links() == {}  # nothing was done on input that cannot be parsed where it matters


def test_proc_devices_other_drivers_unusable_line_is_skipped_with_a_warning(fakehost, nvsymlinkd_cli):
    """Another driver's line of 5,000 digits says nothing about NVIDIA's majors: the rest is usable."""
    from tests.fakehost import standard_host

    host = standard_host(fakehost.root)
    text = host.path("/proc/devices").read_text().replace("Character devices:\n", f"Character devices:\n{HUGE} x\n")
    host.write("/proc/devices", text)
    proc = nvsymlinkd_cli("--root", host.root, "sync", "--json")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    warning = "/proc/devices:2: major '111111111"
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"nvsymlinkd: warning: {warning}"), proc.stderr
    assert "for 'x': line skipped" in proc.stderr
    doc = json.loads(proc.stdout)
    assert any(w.startswith(warning) for w in doc["warnings"])
    assert host.links(), "the NVIDIA nodes are linked all the same"
    for argv in (["check", "--no-host", "--no-bus"], ["repair", "--dry-run"]):
        proc = nvsymlinkd_cli("--root", host.root, *argv)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, (argv, proc.stderr)


def fake_v1(host, parent_rules: str, leaf_rules: str) -> str:
    """A v1 devices hierarchy as plain files (the kernel itself never lists a 5,000-digit minor)."""
    base = "/sys/fs/cgroup/devices/kubepods"
    host.write(f"{base}/devices.list", parent_rules)
    host.write(f"{base}/{CID}/devices.list", leaf_rules)
    host.write(f"{base}/{CID}/devices.allow", "")
    return f"/kubepods/{CID}"


@pytest.mark.parametrize("where", ["parent", "leaf"])
def test_devices_list_rule_of_thousands_of_digits(fakehost, nvsymlinkd_cli, where):
    fakehost.proc_devices({"nvidia-frontend": 195})
    for minor in (0, 1):
        fakehost.node(f"/dev/nvidia{minor}", 195, minor)
    huge = f"c 195:{'9' * 5000} rw\n"
    ok_leaf = "c 195:0 rw\n"
    cgroup = fake_v1(fakehost, huge if where == "parent" else "a *:* rwm\n", huge + ok_leaf if where == "leaf" else ok_leaf)
    Layouts(fakehost).runc(CID, oci_spec(rules=[spec_rule(195, 0), spec_rule(195, 1)]), cgroup=cgroup)
    rc, doc = check(nvsymlinkd_cli, str(fakehost.root))
    assert rc == 1
    assert doc["containers"][0]["verdict"] == ("lost" if where == "parent" else "unknown"), doc
    for argv in (["repair", "--dry-run", "--json"], ["repair", "--json"]):
        proc = nvsymlinkd_cli("--root", fakehost.root, *argv)
        assert "Traceback" not in proc.stderr, proc.stderr
        assert proc.returncode == 1, (argv, proc.stdout, proc.stderr)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 6000), st.sampled_from(["c {n}:0 rw", "c 195:{n} rw", "b {n}:{n} m"]),
       st.sampled_from(["{n} nvidia", "{n} x"]), st.sampled_from(["config {n}", "gpu0/gi1/access {n}"]))
def test_host_file_parsers_refuse_huge_numbers_cleanly(digits, rule, proc_line, mig_line):
    from nvsymlinkd.access.rules import parse_devices_list
    from nvsymlinkd.errors import HostFileError
    from nvsymlinkd.host.driverinfo import parse_mig_minors, parse_params
    from nvsymlinkd.host.procdevices import parse_proc_devices

    n = "9" * digits
    for parse, text in ((lambda t: parse_devices_list(t, "/x/devices.list"), rule.format(n=n) + "\n"),
                        (parse_proc_devices, "Character devices:\n" + proc_line.format(n=n) + "\n"),
                        (parse_mig_minors, mig_line.format(n=n) + "\n"),
                        (parse_params, f"DeviceFileUID: {n}\n")):
        try:
            parse(text)
        except HostFileError as exc:
            assert len(str(exc)) < 200 and "\n" not in str(exc)


def test_scope_device_allow_of_thousands_of_digits_is_unmapped():
    from nvsymlinkd.host.procdevices import Majors
    from nvsymlinkd.host.root import HostRoot
    from nvsymlinkd.systemd.scopes import ScopeDevices, map_entries

    entries = ((f"/dev/char/{HUGE}:0", "rw"), (f"char-{HUGE}", "rw"), ("/dev/char/195:0", "rw"))
    sd = map_entries(HostRoot("/"), ScopeDevices("docker-x.scope", "files", "strict", entries, ()), Majors({}))
    assert [r.describe() for r in sd.rules] == ["allow c 195:0 rw"] and len(sd.unmapped) == 2


# --- a name listed twice in /proc/devices ---------------------------------------------------------

def test_a_second_major_for_a_name_never_drops_a_link(fakehost, nvsymlinkd_cli):
    from tests.fakehost import standard_host

    host = standard_host(fakehost.root, names=("nvidia",))
    nvsymlinkd_cli("--root", host.root, "sync", check=0)
    before = host.links()
    assert "195:0" in before and "195:255" in before
    text = host.path("/proc/devices").read_text()
    host.write("/proc/devices", text.replace("Block devices:", "300 nvidia\n\nBlock devices:"))
    proc = nvsymlinkd_cli("--root", host.root, "sync", "--json")
    assert "Traceback" not in proc.stderr, proc.stderr
    assert host.links() == before, proc.stdout
    assert not [a for a in json.loads(proc.stdout)["actions"] if a["action"] == "remove"], proc.stdout


# --- the daemon's container side, in process: journal once, count, one file costs one container ---

class RecordingJournal:
    """The daemon's journal interface, keeping (kind, message, fields) of every event."""

    def __init__(self):
        self.events, self.lines = [], []

    def event(self, kind, priority, message, **fields):
        self.events.append((kind, message, fields))

    def log(self, priority, message, kind=None, **fields):
        self.lines.append(message)

    def __getattr__(self, name):  # warning, debug, notice, ...
        return lambda message, **fields: self.lines.append(message)


def test_daemon_journals_an_unreadable_gpu_container_once_and_counts_it(fakehost, v1_parent):
    from nvsymlinkd.config import Config
    from nvsymlinkd.daemon.containerwatch import ContainerWatch
    from nvsymlinkd.host.root import HostRoot
    from nvsymlinkd.metrics import Metrics

    h = LostHost(fakehost, v1_parent, "containerd-spec-only")
    _symlink_to_itself(h, h.spec)
    # a second container whose state.json is nested 200,000 deep: it costs only itself
    lay = Layouts(fakehost, next_pid=50000)
    lay.runc("deep1", GPU_SPEC, cgroup=v1_cgroup(v1_parent, "deep1", ["c 195:0 rw", "c 195:255 rw"]))
    h.put("/run/runc/deep1/state.json", '{"a":' + "[" * DEEP + "]" * DEEP + "}")
    lay.runc("lost2", GPU_SPEC, cgroup=v1_cgroup(v1_parent, "lost2", ["c 195:0 rw", "c 195:255 rw"]))
    journal, metrics = RecordingJournal(), Metrics()
    watch = ContainerWatch(journal, HostRoot(h.root), lambda: Config().with_overrides(repair="off"),
                           use_bus=False, metrics=metrics)
    for _ in range(3):
        report = watch.verify_and_repair("test")
    assert {c.id: c.verdict for c in report.containers} == {CID: "unknown", "deep1": "unknown", "lost2": "lost"}
    unknown = [(m, f) for k, m, f in journal.events if k == "container-unknown"]
    assert sorted(f["container_id"] for _, f in unknown) == sorted([CID, "deep1"]), journal.events
    assert any(h.spec in m and "symlink" in m for m, _ in unknown), unknown
    assert any("nested too deeply" in m for m, _ in unknown), unknown
    assert metrics.containers == {"ok": 0, "at-risk": 0, "lost": 1, "denied": 0, "unknown": 2}
    assert not any("verification failed" in line for line in journal.lines), journal.lines
