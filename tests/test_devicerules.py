"""cgroup v1 devices.list: parsing, the kernel's matching rules, and a real-kernel comparison."""

from __future__ import annotations

import os
import random
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nvsymlinkd.access.cgroup import find_cgroup_mounts, parse_mountinfo, read_access
from nvsymlinkd.access.rules import decide, parse_devices_list
from nvsymlinkd.errors import HostFileError
from nvsymlinkd.host.devices import Device, Rule
from nvsymlinkd.host.root import HostRoot
from tests import bpfasm
from tests.bpfasm import CgroupDirs, kernel_probe, make_nodes
from tests.conftest import skip_or_fail

PATH = "/sys/fs/cgroup/devices/docker/abc/devices.list"
SEED = int(os.environ.get("NVSD_TEST_SEED", "20261122"))

RUNC_GPU = """c 1:5 rwm
c 1:3 rwm
c 1:9 rwm
c 1:8 rwm
c 5:0 rwm
c 5:1 rwm
c *:* m
b *:* m
c 136:* rwm
c 5:2 rwm
c 10:200 rwm
c 195:0 rw
c 195:255 rw
c 508:0 rw
"""


def allowed(text, device, access):
    return decide(parse_devices_list(text, PATH), device, access).allowed


def test_parse_runc_gpu_container():
    rules = parse_devices_list(RUNC_GPU, PATH)
    assert len(rules) == 14
    assert rules[6] == Rule(True, "c", None, None, "m")
    assert rules[8] == Rule(True, "c", 136, None, "rwm")
    assert str(rules[11]) == "c 195:0 rw"


def test_runc_gpu_container_decisions():
    assert allowed(RUNC_GPU, Device("c", 195, 0), "rw")
    assert allowed(RUNC_GPU, Device("c", 195, 255), "r")
    assert not allowed(RUNC_GPU, Device("c", 195, 1), "r")          # another GPU
    assert not allowed(RUNC_GPU, Device("c", 508, 1), "rw")         # nvidia-uvm-tools not granted
    assert allowed(RUNC_GPU, Device("c", 195, 1), "m")              # c *:* m
    assert not allowed(RUNC_GPU, Device("c", 195, 0), "rwm")        # m is a separate rule
    assert allowed(RUNC_GPU, Device("c", 136, 7), "rw")             # c 136:* wildcard minor
    assert allowed(RUNC_GPU, Device("b", 8, 0), "m") and not allowed(RUNC_GPU, Device("b", 8, 0), "r")


def test_one_rule_must_cover_all_requested_access():
    # the kernel does not add up access across rules (match_exception)
    text = "c 195:0 r\nc 195:* w\n"
    assert allowed(text, Device("c", 195, 0), "r") and allowed(text, Device("c", 195, 0), "w")
    assert not allowed(text, Device("c", 195, 0), "rw")
    d = decide(parse_devices_list(text, PATH), Device("c", 195, 0), "rw")
    assert "no rule covering c 195:0 rw" in d.reason and "c 195:0 r" in d.reason


def test_allow_all_line_and_its_caveat():
    d = decide(parse_devices_list("a *:* rwm\n", PATH), Device("b", 8, 0), "rwm")
    assert d.allowed and "allow-all" in d.reason and "deny exceptions" in d.reason


def test_empty_list_denies_everything():
    d = decide(parse_devices_list("", PATH), Device("c", 1, 3), "r")
    assert not d.allowed and d.reason == "devices.list has no rule for c 1:3 r"


def test_type_mismatch_and_wildcard_major():
    assert allowed("c *:0 r\n", Device("c", 7, 0), "r")
    assert not allowed("c *:0 r\n", Device("b", 7, 0), "r")
    assert not allowed("c *:0 r\n", Device("c", 7, 1), "r")


@pytest.mark.parametrize("line,where", [
    ("c 195:0", "expected"), ("x 1:3 r", "device type"), ("c 1:3 q", "access"),
    ("c a:3 r", "major"), ("c 1:-3 r", "minor"), ("c 1:3: r", "expected"),
    ("c 99999999999:0 r", "32 bits"), ("c 1:3 ", "expected"), ("c 1 3 r", "expected"),
])
def test_garbage_names_file_and_line(line, where):
    with pytest.raises(HostFileError) as e:
        parse_devices_list("c 1:3 rwm\n" + line + "\n", PATH)
    assert e.value.line == 2 and e.value.path == PATH
    assert str(e.value).startswith(f"{PATH}:2: ") and where in str(e.value)


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("abcmrw*: 0123456789\n\t\x00é")), max_size=60))
def test_property_garbage_only_raises_host_file_error(text):
    try:
        rules = parse_devices_list(text, PATH)
    except HostFileError as e:
        assert e.path == PATH and e.line is not None
        return
    for rule in rules:   # whatever parses must round-trip and decide without error
        assert parse_devices_list(str(rule), PATH) == [rule]
        decide(rules, Device("c", 1, 3), "rw")


rule_strategy = st.builds(
    Rule, st.just(True), st.sampled_from(["c", "b"]), st.one_of(st.none(), st.integers(0, 2**32 - 1)),
    st.one_of(st.none(), st.integers(0, 2**32 - 1)),
    st.sampled_from(["r", "w", "m", "rw", "rm", "wm", "rwm"]))


@settings(max_examples=300, deadline=None)
@given(st.lists(rule_strategy, max_size=8), st.sampled_from(["c", "b"]), st.integers(0, 300),
       st.integers(0, 300), st.sampled_from(["r", "w", "m", "rw"]))
def test_property_decision_is_the_kernel_rule(rules, dev_type, major, minor, access):
    text = "".join(f"{r}\n" for r in rules)
    expected = any((r.major in (None, major)) and (r.minor in (None, minor)) and r.dev_type == dev_type
                   and set(access) <= set(r.access) for r in rules)
    assert allowed(text, Device(dev_type, major, minor), access) == expected


def test_mountinfo_finds_hybrid_and_escapes():
    text = ("36 31 0:33 / /sys/fs/cgroup/devices rw,relatime - cgroup cgroup rw,devices\n"
            "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
            "50 31 0:40 / /mnt/with\\040space rw - cgroup2 none rw\n"
            "garbage line\n")
    mounts = parse_mountinfo(text)
    assert [m.mountpoint for m in mounts] == ["/sys/fs/cgroup/devices", "/sys/fs/cgroup/unified",
                                              "/mnt/with space"]
    assert "devices" in mounts[0].superopts


def test_read_access_under_fake_root(tmp_path):
    """--root trees: the devices.list of a fixture host is read through HostRoot."""
    root = tmp_path / "root"
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/mountinfo").write_text(
        "36 31 0:33 / /sys/fs/cgroup/devices rw - cgroup cgroup rw,devices\n")
    d = root / "sys/fs/cgroup/devices/docker/abc"
    d.mkdir(parents=True)
    (d / "devices.list").write_text(RUNC_GPU)
    policy = read_access(HostRoot(str(root)), "/docker/abc", None)
    v = policy.check(Device("c", 195, 0), "rw")
    assert (v.state, v.reason) == ("allow", "devices.list has c 195:0 rw")
    assert policy.check(Device("c", 195, 3), "r").state == "deny"
    assert policy.describe()[0].startswith(f"cgroup v1 devices: {PATH}: c 1:5 rwm")
    (d / "devices.list").write_text("c 195:0 rw\nc 195:x r\n")
    v = read_access(HostRoot(str(root)), "/docker/abc", None).check(Device("c", 195, 0), "r")
    assert v.state == "unknown" and f"{PATH}:2" in v.reason
    v = read_access(HostRoot(str(root)), "/docker/gone", None).check(Device("c", 195, 0), "r")
    assert v.state == "unknown" and "cgroup gone" in v.reason
    v = read_access(HostRoot(str(root)), "/docker/../../../etc", None).check(Device("c", 195, 0), "r")
    assert v.state == "unknown"
    assert read_access(HostRoot(str(root)), None, None).check(Device("b", 8, 0), "rwm").state == "allow"


# --- the real kernel -----------------------------------------------------------------------

@pytest.fixture
def v1_devices(tmp_path):
    """The v1 devices hierarchy: the mounted one, or one we mount (pure cgroup2 hosts)."""
    if os.geteuid() != 0:
        skip_or_fail("needs root (cgroups, mknod)")
    root = HostRoot("/")
    mounts = find_cgroup_mounts(root)
    mounted_here = None
    if mounts.v1_devices is None:
        mnt = tmp_path / "devices-hierarchy"
        mnt.mkdir()
        proc = subprocess.run(["mount", "-t", "cgroup", "-o", "devices", "nvsd-devices", str(mnt)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            skip_or_fail(f"no cgroup v1 devices controller: {proc.stderr.strip()}")
        mounted_here = str(mnt)
        mounts = find_cgroup_mounts(root)
    dirs = CgroupDirs(mounts.v1_devices.mountpoint, "v1")
    yield mounts, dirs
    dirs.close()
    if mounted_here:
        subprocess.run(["umount", mounted_here], check=False)


def _own_v2_cgroup():
    with open("/proc/self/cgroup") as f:
        for line in f:
            if line.startswith("0::"):
                return line[3:].strip()
    return None


def test_v1_random_rule_sets_match_kernel(v1_devices, tmp_path):
    """Whitelist cgroups (runc's mode) built by devices.allow/deny writes; every verdict of
    read_access is compared with the kernel's answer to open()/mknod() from a child."""
    mounts, dirs = v1_devices
    rng = random.Random(SEED)
    chars = bpfasm.free_majors("Character")[:3]
    blocks = bpfasm.free_majors("Block")[:1]
    devices = [("c", m, n) for m in chars for n in (0, 1, 255)] + [("b", blocks[0], 0)]
    nodes = make_nodes(str(tmp_path), devices)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    v2 = _own_v2_cgroup()
    stats = {"sets": 0, "cases": 0, "mismatches": 0, "allow": 0, "deny": 0, "unknown": 0}
    examples = []
    for n in range(60):
        cg = dirs.make(f"set{n}")
        real = dirs.real(cg)
        with open(f"{real}/devices.deny", "w") as f:
            f.write("a")
        for _ in range(rng.randint(0, 8)):
            t = rng.choice(["c", "c", "b"])
            major = "*" if rng.random() < 0.2 else str(rng.choice((chars if t == "c" else blocks) + [1]))
            minor = "*" if rng.random() < 0.3 else str(rng.choice([0, 1, 255]))
            acc = rng.choice(["r", "w", "m", "rw", "rwm", "wm"])
            knob = "devices.allow" if rng.random() < 0.75 else "devices.deny"
            try:
                with open(f"{real}/{knob}", "w") as f:
                    f.write(f"{t} {major}:{minor} {acc}")
            except OSError:
                pass   # whatever the kernel refused is simply not in devices.list
        policy = read_access(HostRoot("/"), cg, v2, mounts=mounts)
        probes = [(t, ma, mi, acc) for (t, ma, mi) in devices for acc in ("r", "w", "rw", "m")]
        truth = kernel_probe([f"{real}/cgroup.procs"], nodes, str(scratch), probes)
        stats["sets"] += 1
        for probe, kernel_says in zip(probes, truth):
            v = policy.check(Device(*probe[:3]), probe[3])
            stats["cases"] += 1
            stats[kernel_says] = stats.get(kernel_says, 0) + 1
            if v.state == "unknown":
                stats["unknown"] += 1
            if v.state != kernel_says:
                stats["mismatches"] += 1
                examples.append(f"set {n} {probe}: we say {v.state} ({v.reason}), kernel {kernel_says}")
    print(f"\nv1 devices.list: {stats['sets']} rule sets, {stats['cases']} cases, "
          f"{stats['mismatches']} mismatches, {stats['unknown']} unknown; kernel allowed "
          f"{stats['allow']}, denied {stats['deny']} (seed {SEED})")
    assert stats["mismatches"] == 0, "\n".join(examples[:10])
    assert stats["allow"] > stats["cases"] // 20 and stats["deny"] > stats["cases"] // 20


def test_v1_allow_all_mode_matches_kernel(v1_devices, tmp_path):
    mounts, dirs = v1_devices
    chars = bpfasm.free_majors("Character")[:1]
    nodes = make_nodes(str(tmp_path), [("c", chars[0], 0)])
    cg = dirs.make("allowall")
    policy = read_access(HostRoot("/"), cg, _own_v2_cgroup(), mounts=mounts)
    probes = [("c", chars[0], 0, acc) for acc in ("r", "w", "rw", "m")]
    truth = kernel_probe([dirs.real(cg) + "/cgroup.procs"], nodes, str(tmp_path), probes)
    assert truth == ["allow"] * 4
    assert [policy.check(Device(*p[:3]), p[3]).state for p in probes] == ["allow"] * 4
