"""The GPU smoke suite (tests/gpu/) without a GPU: its judge table-tested, its script importable and
runnable, its specs valid, and its container mechanics (real runc, fake nodes) against the kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import need_tool, skip_or_fail
from tests.gpu import judge, smoke

GPU_DIR = Path(__file__).parent / "gpu"

WORKS = {"smi_rc": 0, "smi_text": "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)", "nvml": "ok", "nvml_count": 1,
         "cuinit": 0}
DENIED = {"smi_rc": 255, "smi_text": "Failed to initialize NVML: Unknown Error", "nvml": "Unknown Error",
          "cuinit": 100}
NO_UVM = {"smi_rc": 0, "smi_text": "GPU 0: NVIDIA H100", "nvml": "ok", "nvml_count": 1, "cuinit": 999}


def ctr(name="x", expect=None, inside=None, check=None, dry=None, repair=None, after=None, after_check=None, **kw):
    c = {"name": name, "expect": expect or {}, "inside": inside, "check": check}
    for key, value in (("dry_run", dry), ("repair", repair), ("after", after), ("after_check", after_check)):
        if value is not None:
            c[key] = value
    c.update(kw)
    return c


def one(c):
    return judge.judge_container(c)


@pytest.mark.parametrize("inside, state", [
    (WORKS, judge.WORKS),
    (DENIED, judge.FAILS),
    (NO_UVM, judge.NO_CUDA),
    ({"smi_rc": 0, "nvml": "Unknown Error", "cuinit": 100}, judge.FAILS),   # NVML decides over a lucky smi
    ({"smi_rc": None, "nvml": None, "cuinit": None, "opens": {"/dev/nvidia0": "ENXIO", "/dev/nvidiactl": "ok"}},
     judge.WORKS),
    ({"smi_rc": None, "nvml": None, "cuinit": None, "opens": {"/dev/nvidia0": "EPERM", "/dev/nvidiactl": "ok"}},
     judge.FAILS),
    ({"smi_rc": None, "nvml": None, "cuinit": None, "opens": {}}, judge.UNKNOWN),
    ({"error": "no probe output"}, judge.UNKNOWN),
    (None, judge.UNKNOWN),
])
def test_inside_state(inside, state):
    assert judge.inside_state(inside) == state


# (what the container sees, what check says, what the scenario expects) -> outcome and a reason's words
CASES = [
    ("healthy", ctr(expect={"verdict": "ok", "inside": "works", "repair": "nothing"}, inside=WORKS,
                    check={"verdict": "ok", "rc": 0}, dry={"status": None, "rc": 0}, repair={"status": None, "rc": 0},
                    after=WORKS, after_check={"verdict": "ok", "rc": 0}), "agree", None),
    ("cannot open its GPUs, check says ok", ctr(inside=DENIED, check={"verdict": "ok", "rc": 0}),
     "DISAGREE", "check says ok but the container cannot use its GPUs"),
    ("no uvm, check says ok", ctr(inside=NO_UVM, check={"verdict": "ok", "rc": 0}),
     "DISAGREE", "cannot use its GPUs (inside: no-cuda)"),
    ("uvm missing, found", ctr(expect={"verdict": "at-risk-uvm-missing", "inside": "no-cuda", "repair": "not-repaired"},
                               inside=NO_UVM, check={"verdict": "at-risk", "kinds": ["at-risk-uvm-missing"], "rc": 1},
                               repair={"status": "cannot-repair", "rc": 1}, after=NO_UVM), "agree", None),
    ("uvm missing, a different at-risk", ctr(expect={"verdict": "at-risk-uvm-missing"}, inside=NO_UVM,
                                             check={"verdict": "at-risk", "kinds": ["at-risk-not-in-spec"], "rc": 1}),
     "DISAGREE", "expected verdict at-risk-uvm-missing"),
    ("lost but the container works", ctr(inside=WORKS, check={"verdict": "lost", "rc": 1}),
     "DISAGREE", "check says lost but the container uses its GPUs"),
    ("lost, exit 0", ctr(inside=DENIED, check={"verdict": "lost", "rc": 0}), "DISAGREE", "exits 0"),
    ("ok, exit 1", ctr(inside=WORKS, check={"verdict": "ok", "rc": 1}), "DISAGREE", "check says ok but exits 1"),
    ("never allowed: denied, not repaired",
     ctr(expect={"verdict": "denied", "inside": "fails", "repair": "not-repaired"}, inside=DENIED,
         check={"verdict": "denied", "rc": 1}, repair={"status": None, "rc": 1}, after=DENIED), "agree", None),
    ("never allowed: repair lists it as denied (exit 1)",
     ctr(expect={"verdict": "denied", "inside": "fails", "repair": "not-repaired"}, inside=DENIED,
         check={"verdict": "denied", "rc": 1}, dry={"status": "denied", "rc": 1}, repair={"status": "denied", "rc": 1},
         after=DENIED, after_check={"verdict": "denied", "rc": 1}), "agree", None),
    ("hook grant lost, but check says denied",
     ctr(expect={"verdict": "lost", "inside": "fails", "repair": "repaired"}, inside=DENIED,
         check={"verdict": "denied", "rc": 1}, repair={"status": "denied", "rc": 1, "text": "nothing trusted"},
         after=DENIED), "DISAGREE", "expected verdict lost, check said denied"),
    ("never allowed: repair grants what nobody granted",
     ctr(expect={"verdict": "denied", "repair": "not-repaired"}, inside=DENIED, check={"verdict": "denied", "rc": 1},
         repair={"status": "repaired", "rc": 0}, after=WORKS, after_check={"verdict": "ok", "rc": 0}),
     "DISAGREE", "repair claims repaired where nothing trusted"),
    ("repaired but inside still fails",
     ctr(expect={"verdict": "lost", "repair": "repaired"}, inside=DENIED, check={"verdict": "lost", "rc": 1},
         dry={"status": "would-repair", "rc": 1}, repair={"status": "repaired", "rc": 0}, after=DENIED),
     "DISAGREE", "repair says repaired but inside still fails"),
    ("repaired, inside works, check still lost",
     ctr(expect={"verdict": "lost", "repair": "repaired"}, inside=DENIED, check={"verdict": "lost", "rc": 1},
         repair={"status": "repaired", "rc": 0}, after=WORKS, after_check={"verdict": "lost", "rc": 1}),
     "DISAGREE", "check afterwards says lost"),
    ("repair refused (cgroup v2 without systemd, before branch v2repair)",
     ctr(expect={"verdict": "lost", "inside": "fails", "repair": "repaired"}, inside=DENIED,
         check={"verdict": "lost", "rc": 1}, dry={"status": "cannot-repair", "rc": 1},
         repair={"status": "cannot-repair", "rc": 1, "text": "cgroup v2 with the cgroupfs driver: ..."}, after=DENIED),
     "DISAGREE", "repair refused: cannot-repair (rc 1): cgroup v2"),
    ("a loss no daemon saw: ok, nothing to repair (issue 24 item 2)",
     ctr(expect={"verdict": "lost", "inside": "fails", "repair": "repaired"}, inside=DENIED,
         check={"verdict": "ok", "rc": 0}, repair={"status": None, "rc": 0}, after=DENIED),
     "DISAGREE", "repair found nothing to repair"),
    ("lost, repaired, works again",
     ctr(expect={"verdict": "lost", "inside": "fails", "repair": "repaired"}, before=WORKS,
         before_check={"verdict": "ok", "rc": 0}, inside=DENIED, check={"verdict": "lost", "rc": 1},
         dry={"status": "would-repair", "rc": 1}, repair={"status": "repaired", "rc": 0}, after=WORKS,
         after_check={"verdict": "ok", "rc": 0}), "agree", None),
    ("hook grant back: at risk as before the loss",
     ctr(expect={"verdict": "lost", "repair": "repaired"}, before=WORKS,
         before_check={"verdict": "at-risk", "kinds": ["at-risk-not-in-spec"], "rc": 1}, inside=DENIED,
         check={"verdict": "lost", "rc": 1}, repair={"status": "repaired", "rc": 0}, after=WORKS,
         after_check={"verdict": "at-risk", "kinds": ["at-risk-not-in-spec"], "rc": 1}), "agree", None),
    ("repaired, but at risk where it was ok before",
     ctr(expect={"verdict": "lost", "repair": "repaired"}, before=WORKS, before_check={"verdict": "ok", "rc": 0},
         inside=DENIED, check={"verdict": "lost", "rc": 1}, repair={"status": "repaired", "rc": 0}, after=WORKS,
         after_check={"verdict": "at-risk", "kinds": ["at-risk-scope"], "rc": 1}),
     "DISAGREE", "check afterwards says at-risk-scope"),
    ("the daemon's first pass gives it back",
     ctr(expect={"verdict": "lost", "inside": "fails", "repair": "repaired"}, inside=DENIED,
         check={"verdict": "lost", "rc": 1}, repair={"status": "repaired", "rc": None, "by": "daemon"}, after=WORKS,
         after_check={"verdict": "ok", "rc": 0}), "agree", None),
    ("the daemon's first pass says nothing",
     ctr(expect={"verdict": "lost", "inside": "fails", "repair": "repaired"}, inside=DENIED,
         check={"verdict": "ok", "rc": 0}, after=DENIED,
         repair={"status": None, "rc": None, "by": "daemon", "text": "the daemon's first pass said nothing"}),
     "DISAGREE", "the daemon's first pass gave nothing back"),
    ("a dry run that repairs", ctr(inside=DENIED, check={"verdict": "lost", "rc": 1}, dry={"status": "repaired", "rc": 0}),
     "DISAGREE", "a dry run must change nothing"),
    ("healthy container, repair does something", ctr(expect={"repair": "nothing"}, inside=WORKS,
                                                    check={"verdict": "ok", "rc": 0},
                                                    repair={"status": "repaired", "rc": 0}),
     "DISAGREE", "repair of a healthy container says repaired"),
    ("lost before the loss", ctr(before=WORKS, before_check={"verdict": "lost", "rc": 1}, inside=DENIED,
                                 check={"verdict": "lost", "rc": 1}),
     "DISAGREE", "before the loss the container uses its GPUs but check said lost"),
    ("no uvm, no driver tools: the nodes it has open",
     ctr(expect={"verdict": "at-risk-uvm-missing", "inside": "no-cuda"},
         inside={"smi_rc": None, "nvml": None, "cuinit": None, "opens": {"/dev/nvidia0": "ok"}},
         check={"verdict": "at-risk", "kinds": ["at-risk-uvm-missing"], "rc": 1}), "agree", None),
    ("the scenario did not take", ctr(expect={"inside": "fails"}, inside=WORKS, check={"verdict": "ok", "rc": 0}),
     "ERROR", "scenario not reproduced: inside works"),
    ("the probe failed", ctr(inside={"error": "timed out after 150 s"}, check={"verdict": "ok", "rc": 0}),
     "ERROR", "probe inside failed"),
    ("runc failed", ctr(error="RuntimeError: runc run failed (rc 1)"), "ERROR", "runc run failed"),
    ("check gave no JSON", ctr(inside=DENIED, check={"rc": 2, "verdict": None, "error": "no JSON (rc 2)"}),
     "ERROR", "check: no JSON"),
    ("repair was never run", ctr(expect={"repair": "repaired"}, inside=DENIED, check={"verdict": "lost", "rc": 1}),
     "ERROR", "repair was not run"),
]


@pytest.mark.parametrize("title, c, outcome, words", CASES, ids=[c[0] for c in CASES])
def test_judge_container(title, c, outcome, words):
    got = one(c)
    assert got["outcome"] == outcome, (title, got)
    if words:
        assert any(words in text for text in got["reasons"] + got["errors"]), got
    else:
        assert got["reasons"] == [] and got["errors"] == [], got


def test_a_disagreement_outranks_an_error_in_a_row():
    got = one(ctr(expect={"inside": "works"}, inside=DENIED, check={"verdict": "ok", "rc": 0}))
    assert got["outcome"] == "DISAGREE" and got["errors"]


@pytest.mark.parametrize("sync, outcome, words", [
    ({"rc": 0, "links": {"nodes": 6, "exact": 6, "problems": []}}, "agree", None),
    ({"rc": 0, "links": {"nodes": 6, "exact": 5, "problems": ["/dev/char/195:0 missing"]}}, "DISAGREE", "link problem"),
    ({"rc": 1, "links": {"nodes": 6, "exact": 6, "problems": []}}, "DISAGREE", "sync exited 1"),
    ({"rc": 0, "links": {"nodes": 0, "exact": 0, "problems": []}}, "ERROR", "no NVIDIA device nodes"),
])
def test_judge_sync(sync, outcome, words):
    got = judge.judge_sync(sync)
    assert got["outcome"] == outcome
    assert words is None or any(words in t for t in got["reasons"] + got["errors"])


@pytest.mark.parametrize("nvml, outcome, words", [
    ({"truth": {"ok": True, "count": 1}, "finding": {"status": "info", "detail": "NVML initialises; 1 GPUs, matching the nodes"}},
     "agree", None),
    ({"truth": {"ok": True, "count": 1}, "finding": {"status": "warn", "detail": "NVML: Unknown Error"}},
     "DISAGREE", "NVML works on the host but check warns"),
    ({"truth": {"ok": False, "error": "Unknown Error"}, "finding": {"status": "info", "detail": "NVML initialises"}},
     "DISAGREE", "NVML fails on the host"),
    ({"truth": {"ok": True, "count": 1}, "finding": {"status": "info", "detail": "not checked (pynvml not installed)"}},
     "DISAGREE", "did not check NVML"),
    ({"truth": {"ok": True, "count": 2}, "finding": {"status": "info", "detail": "NVML initialises; 1 GPUs"}},
     "DISAGREE", "NVML counts 2 GPU(s)"),
    ({"truth": {"ok": True, "count": 1}, "finding": None}, "ERROR", "no nvml host finding"),
])
def test_judge_nvml(nvml, outcome, words):
    got = judge.judge_nvml(nvml)
    assert got["outcome"] == outcome, got
    assert words is None or any(words in t for t in got["reasons"] + got["errors"]), got


def test_judge_latency():
    ok = judge.judge_latency("daemon: relink", {"tries": 20, "ms": [0.5] * 19 + [0.9], "failures": 0}, 20)
    assert ok["outcome"] == "agree" and "20/20 p50 0.50/p99 0.90 ms" in ok["cells"][1]
    late = judge.judge_latency("daemon: relink", {"tries": 20, "ms": [0.5] * 19, "failures": 1, "timeout_ms": 2000}, 20)
    assert late["outcome"] == "DISAGREE" and "1 of 20 not linked within 2000 ms" in late["reasons"][0]
    short = judge.judge_latency("daemon: relink", {"tries": 3, "ms": [0.5] * 3, "failures": 0}, 20)
    assert short["outcome"] == "ERROR"
    assert judge.judge_latency("x", {"error": "the daemon did not say READY=1"})["outcome"] == "ERROR"
    assert judge.pct([3.0, 1.0, 2.0], 50) == 2.0


def test_exit_codes_and_one_table():
    healthy = ctr(name="a-healthy", expect={"verdict": "ok"}, inside=WORKS, check={"verdict": "ok", "rc": 0})
    denied_ok = ctr(name="c-never-allowed", expect={"verdict": "denied"}, inside=DENIED, check={"verdict": "ok", "rc": 0})
    broken = ctr(name="e-hook-lost", error="RuntimeError: runc run failed")
    host = {"sync": {"rc": 0, "links": {"nodes": 6, "exact": 6, "problems": []}}}
    assert judge.judge_all({"host": host, "containers": [healthy]})["exit"] == 0
    assert judge.judge_all({"containers": [healthy, broken]})["exit"] == 2
    assert judge.judge_all({"containers": [healthy, broken, denied_ok]})["exit"] == 1
    assert judge.judge_all({})["exit"] == 2                                   # nothing observed is no pass
    assert judge.judge_all({"containers": [healthy], "fatal": "signal 15"})["exit"] == 2
    skipped = judge.judge_all({"containers": [healthy], "skipped": [{"name": "d-replaced", "why": "out of time"}]})
    assert skipped["exit"] == 2 and "not run: out of time" in skipped["table"]

    table = judge.judge_all({"host": host, "containers": [healthy, denied_ok, broken]})["table"]
    lines = table.splitlines()
    assert lines[0].split(" | ")[0].strip() == "scenario" and lines[0].endswith("agree?")
    assert sum(1 for line in lines if line.startswith("scenario")) == 1      # one table
    row = next(line for line in lines if line.startswith("c-never-allowed"))
    assert "255 / err / 100 NO_DEVICE" in row and "ok (rc 0)" in row and row.rstrip().endswith("NO [1,2]")
    assert "[1] check says ok but the container cannot use its GPUs (inside: fails)" in lines
    assert any(line.startswith("e-hook-lost") and "ERROR [3]" in line for line in lines)
    assert "rows: 2 agree, 1 disagree, 1 error" in lines
    said = lines.index("nvidia-smi -L inside (before the loss -> at the check -> after the repair):")
    assert lines[said + 1:] == ["  a-healthy: GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1) (rc 0)",
                                "  c-never-allowed: Failed to initialize NVML: Unknown Error (rc 255)"]
    widths = {len(line.rstrip()) for line in lines[:2]}
    assert all(len(cell.strip()) <= 56 for line in lines[2:6] for cell in line.split(" | ")[:-1])
    assert widths


# --- the script itself, no GPU ----------------------------------------------------------------

def test_smoke_help_runs_without_a_gpu():
    proc = subprocess.run([sys.executable, str(GPU_DIR / "smoke.py"), "--help"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--self-check" in proc.stdout and "--budget" in proc.stdout


def test_spec_patch_is_the_scenarios_container():
    """From a `runc spec`-shaped default: the host's directories bound read-only, /tmp a tmpfs, the nodes,
    rules, env and the NVIDIA hook the scenario asks for; runc's deny-all first."""
    base = {"process": {"terminal": True, "args": ["sh"], "env": ["PATH=/x", "TERM=xterm"]},
            "root": {"path": "rootfs", "readonly": True},
            "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"},
                       {"destination": "/tmp", "type": "bind", "source": "/tmp"}],
            "linux": {"resources": {"devices": [{"allow": False, "access": "rwm"}]}}}
    nodes = [{"name": "nvidia0", "major": 195, "minor": 0}, {"name": "nvidiactl", "major": 195, "minor": 255}]
    sc = {"nodes": nodes, "rules": nodes[:1], "env": ["NVIDIA_VISIBLE_DEVICES=0"]}
    spec = smoke.patch_spec(json.loads(json.dumps(base)), dict(sc, hook=nodes), "gpusmoke-x-1", "/gpusmoke-1",
                            "/tmp/w/bin/nvidia-container-runtime-hook", ["GPUSMOKE_NODES=[]"])
    assert spec["process"]["terminal"] is False and spec["process"]["args"][1:] == ["100000"]
    assert "NVIDIA_VISIBLE_DEVICES=0" in spec["process"]["env"]
    assert [e for e in spec["process"]["env"] if e.startswith("PATH=")] == [
        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
    assert spec["root"] == {"path": "rootfs", "readonly": False}
    assert spec["linux"]["cgroupsPath"] == "/gpusmoke-1/gpusmoke-x-1"
    assert spec["linux"]["devices"][1] == {"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255,
                                           "fileMode": 0o666, "uid": 0, "gid": 0}
    assert spec["linux"]["resources"]["devices"] == [
        {"allow": False, "access": "rwm"}, {"allow": True, "type": "c", "major": 195, "minor": 0, "access": "rwm"}]
    (hook,) = spec["hooks"]["prestart"]
    assert hook["args"] == ["nvidia-container-runtime-hook", "prestart"] and hook["env"] == ["GPUSMOKE_NODES=[]"]
    dests = [m["destination"] for m in spec["mounts"]]
    assert dests.count("/tmp") == 1 and spec["mounts"][-1]["type"] == "tmpfs"
    binds = [m for m in spec["mounts"] if m["type"] == "bind"]
    assert binds and all(m["options"][:2] == ["rbind", "ro"] for m in binds)
    assert not {"/proc", "/sys", "/dev", "/tmp", "/run"} & {m["destination"] for m in binds}
    assert "hooks" not in smoke.patch_spec(json.loads(json.dumps(base)), sc, "c", "/p", None, None)


def test_mountinfo_and_the_link_check(tmp_path, need_root):
    text = ("29 1 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
            "30 29 0:27 / /sys/fs/cgroup/devices rw - cgroup cgroup rw,devices\n")
    assert smoke.parse_mountinfo(text) == [("/sys/fs/cgroup", "cgroup2", "rw,nsdelegate"),
                                           ("/sys/fs/cgroup/devices", "cgroup", "rw,devices")]
    node = tmp_path / "nvidia0"
    os.mknod(node, 0o20600, os.makedev(195, 0))
    good, wrong = tmp_path / "195:0", tmp_path / "195:1"
    os.symlink("nvidia0", good)
    os.symlink("nvidia0", wrong)
    assert smoke._link_ok(good, {"major": 195, "minor": 0}) is None
    assert "resolves to 195:0, not 195:1" in smoke._link_ok(wrong, {"major": 195, "minor": 1})
    assert "missing" in smoke._link_ok(tmp_path / "195:2", {"major": 195, "minor": 2})


def test_self_check_passes_here(need_root):
    need_tool("runc")
    proc = subprocess.run([sys.executable, str(GPU_DIR / "smoke.py"), "--self-check"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "self-check: 8 ok, 0 failed" in proc.stdout


# --- the suite's own container mechanics, against the kernel (no GPU: fake nodes) ----------------

def _suite(tmp_path, *args, env=None):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(GPU_DIR / "smoke.py"), "--fake-nodes", "--out", str(out),
                           "--skip", "daemon", "--skip", "sync", "--skip", "check nvml", "--budget", "200", *args],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, **(env or {})))
    doc = json.loads((out / "gpu-smoke.json").read_text())
    assert "GPU smoke table" in proc.stdout and (out / "gpu-smoke-table.txt").exists(), proc.stdout[-3000:]
    assert not [c for c in os.listdir("/run/runc") if c.startswith("gpusmoke-")] if os.path.isdir("/run/runc") else True
    return proc, {c["name"]: c for c in doc["containers"]}


def _opens(obs):
    return set(obs["opens"].values())


@pytest.mark.parametrize("v2_only", [False, True], ids=["runtime's cgroup", "v2 programs"])
def test_the_suite_builds_each_scenario_the_kernel_agrees(tmp_path, need_root, v2_only):
    """What the scenarios are built to be, checked from inside by open() (ENXIO: allowed, no driver; EPERM:
    denied), whatever nvsymlinkd says about them. v2 programs: on a hybrid host, the loss and the hook's grant
    go through BPF programs on the unified cgroup, as on the GPU host."""
    need_tool("runc")
    mounts = smoke.cgroup_mounts()
    if v2_only:
        if not mounts["v2"]:
            skip_or_fail("needs a cgroup2 mount")
        env, scenarios = {"GPUSMOKE_V2_ONLY": "1"}, ["--skip", "a", "--skip", "b", "--skip", "c", "--skip", "f"]
    else:
        env, scenarios = {}, []
    proc, got = _suite(tmp_path, *scenarios, env=env)
    for name, c in got.items():
        assert not c.get("error"), (name, c["error"], proc.stdout[-3000:])
    if not v2_only:
        assert _opens(got["a-healthy"]["inside"]) == {"ENXIO"}
        assert set(got["b-no-uvm"]["inside"]["opens"]) == {"/dev/nvidia0", "/dev/nvidiactl"}
        assert _opens(got["c-never-allowed"]["inside"]) == {"EPERM"}
        assert got["a-healthy"]["check"]["rc"] is not None
    for name in ("d-replaced", "e-hook-lost") + (() if v2_only else ("f-daemon-first-pass",)):
        assert _opens(got[name]["before"]) == {"ENXIO"}, (name, got[name]["before"])   # granted first
        assert _opens(got[name]["inside"]) == {"EPERM"}, (name, got[name]["inside"])    # then taken
    assert set(got["e-hook-lost"]["before"]["opens"]) == {"/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm",
                                                          "/dev/nvidia-uvm-tools"}  # made by the hook
    assert ("v2: " if v2_only else "v1: ") in got["d-replaced"]["steps"][0]
    if not v2_only:  # the daemon was started after the loss, looked, and was stopped
        assert got["f-daemon-first-pass"]["repair"]["by"] == "daemon"
        assert not got["f-daemon-first-pass"]["repair"]["error"], got["f-daemon-first-pass"]["repair"]


def test_a_bind_runc_cannot_make_falls_back_to_the_essential_directories(tmp_path, need_root):
    """Binding every top-level directory fails on some host (a mount runc cannot bind): the scenario is
    run again with /usr, /etc, /opt, ... and the interpreter's own directories, not lost."""
    need_tool("runc")
    proc, got = _suite(tmp_path, "--skip", "b", "--skip", "c", "--skip", "d", "--skip", "e", "--skip", "f",
                       env={"GPUSMOKE_TEST_BAD_BIND": "1"})
    c = got["a-healthy"]
    assert not c.get("error"), (c, proc.stdout[-2000:])
    assert _opens(c["inside"]) == {"ENXIO"}
    assert "binding every top-level directory failed" in c["steps"][0] and "'usr'" in c["steps"][0]
