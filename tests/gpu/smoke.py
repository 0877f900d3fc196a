#!/usr/bin/env python3
"""GPU smoke suite: nvsymlinkd on a machine with a real NVIDIA driver, judged from inside containers.

Run as root on a GPU host (see docs/testing.md, "The GPU smoke suite"); usually through
tests/gpu/run.sh, which sets up the carried runc and wheels. Steps, each guarded (a failing step
is an ERROR row, never a crash):

  1. `nvsymlinkd sync`, then an independent check of every /dev/char link (st_rdev of what it
     resolves to) and of every NVIDIA node (it has its link)
  2. `nvsymlinkd check --json`: the nvml host finding against NVML on the host
  3. the daemon (`nvsymlinkd run`, no D-Bus, no udev needed): a removed link put back, a new node
     linked (and its link removed with it), latency p50/p99
  4. real runc containers (cgroupfs driver) whose rootfs is the host's directories bound read-only,
     judged from inside (nvidia-smi -L, NVML init, cuInit) and from outside (`check --json ID`,
     `repair --dry-run`, `repair`), then inside and `check` again after the repair:
       a-healthy   devices in the spec and allowed                 -> ok
       b-no-uvm    nvidia-uvm neither created nor allowed          -> at-risk-uvm-missing
       c-never     nodes in linux.devices, never allowed           -> denied, not repaired
       d-replaced  device program replaced like systemd's re-apply -> lost, repaired
       e-hook      NVIDIA hook-style grant, then replaced           -> lost, repaired
       f-daemon    as e, then the daemon started (no repair command) -> lost, given back by its first pass
  5. one table (tests/gpu/judge.py decides), results JSON and the table into --out.

Exit: 0 every row agrees, 1 a disagreement, 2 only errors (the suite could not observe something).
Every subprocess has a timeout and the whole run has a deadline (--budget); containers are
deleted at the end whatever happened.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
if __name__ == "__main__":
    # run as `python3 tests/gpu/smoke.py` (tests/gpu/run.sh, VM scenario s40, --self-check by hand):
    # the checkout's root on the path, for tests.gpu.judge, tests.bpfasm, tests.fakehost and nvsymlinkd
    sys.path.insert(0, str(REPO))

from tests.gpu import judge  # noqa: E402

RUNC_ROOT = "/run/runc"
NVIDIA_NAMES = ("nvidia0", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
HOOK_NAME = "nvidia-container-runtime-hook"
NOT_BOUND = ("proc", "sys", "dev", "tmp", "run")
Obs = Dict[str, Any]

# Run inside the container (and on the host for the truth): open() of each /dev/nvidia* node,
# `nvidia-smi -L`, NVML init, cuInit. One JSON line on stdout; every part guarded.
PROBE = r"""
import ctypes, errno, json, os, stat, subprocess, sys
smi = sys.argv[1] if len(sys.argv) > 1 else ""
cuda_path = sys.argv[2] if len(sys.argv) > 2 else ""
out = {"smi_rc": None, "smi_text": "", "nvml": None, "nvml_count": None, "cuinit": None, "opens": {},
       "notes": []}
try:
    for name in sorted(os.listdir("/dev")):
        path = "/dev/" + name
        if not name.startswith("nvidia"):
            continue
        try:
            if not stat.S_ISCHR(os.lstat(path).st_mode):
                continue
            fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
            os.close(fd)
            out["opens"][path] = "ok"
        except OSError as e:
            out["opens"][path] = errno.errorcode.get(e.errno, str(e.errno))
except OSError as e:
    out["notes"].append("listing /dev: %s" % e)
if smi and os.path.exists(smi):
    try:
        p = subprocess.run([smi, "-L"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=60)
        out["smi_rc"] = p.returncode
        out["smi_text"] = p.stdout.decode(errors="replace").strip()[:400]
    except Exception as e:
        out["smi_text"] = "nvidia-smi: %r" % (e,)
        out["smi_rc"] = -1
else:
    out["notes"].append("no nvidia-smi")
try:
    import pynvml
except Exception as e:
    out["notes"].append("no pynvml: %s" % e)
else:
    try:
        pynvml.nvmlInit()
        out["nvml_count"] = pynvml.nvmlDeviceGetCount()
        out["nvml"] = "ok"
        pynvml.nvmlShutdown()
    except Exception as e:
        out["nvml"] = str(e) or repr(e)
cuda = None
for name in ("libcuda.so.1", cuda_path):
    if not name:
        continue
    try:
        cuda = ctypes.CDLL(name)
        break
    except OSError as e:
        out["notes"].append("no %s: %s" % (name, e))
if cuda is not None:
    try:
        with open("/proc/self/maps") as maps:
            out["libcuda"] = next((l.split()[-1] for l in maps if "libcuda.so" in l), None)
    except OSError:
        pass
    try:
        out["cuinit"] = int(cuda.cuInit(0))
    except Exception as e:
        out["notes"].append("cuInit: %r" % (e,))
print(json.dumps(out))
"""


class Stop(Exception):
    """SIGTERM/SIGINT or the deadline: stop, clean up, print what we have."""


def _on_signal(signum, _frame):
    # once: the cleanup and the table that follow are not interrupted again (run.sh's timeout -k
    # still ends everything 20 s later)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise Stop(f"signal {signum}")


# --- small helpers ------------------------------------------------------------------------

def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_mountinfo(text: str) -> list:
    """(mountpoint, fstype, super options) of each mount."""
    out = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        lf, rf = left.split(), right.split()
        if sep and len(lf) >= 5 and len(rf) >= 3:
            point = lf[4].replace("\\040", " ")
            out.append((point, rf[0], rf[2]))
    return out


def cgroup_mounts() -> Obs:
    """{"v2": mountpoint or None, "devices": v1 devices mountpoint or None} from /proc/self/mountinfo."""
    found: Obs = {"v2": None, "devices": None}
    try:
        text = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return found
    for point, fstype, opts in parse_mountinfo(text):
        if fstype == "cgroup2" and found["v2"] is None:
            found["v2"] = point
        elif fstype == "cgroup" and "devices" in opts.split(",") and found["devices"] is None:
            found["devices"] = point
    return found


def cgroup_dirs(pid: int, v2_only: Optional[bool] = None) -> Obs:
    """The real directories of a process's v2 cgroup and v1 devices cgroup (None where absent).

    v2_only (default: $GPUSMOKE_V2_ONLY set): on a hybrid host, leave the v1 devices cgroup out,
    to exercise the v2 (BPF program) paths on a machine whose runc programs v1."""
    if v2_only is None:
        v2_only = bool(os.environ.get("GPUSMOKE_V2_ONLY"))
    mounts = cgroup_mounts()
    out: Obs = {"v2": None, "devices": None}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "" and mounts["v2"]:
            out["v2"] = mounts["v2"].rstrip("/") + path
        elif "devices" in controllers.split(",") and mounts["devices"] and not v2_only:
            out["devices"] = mounts["devices"].rstrip("/") + path
    return out


def nvidia_nodes() -> List[Obs]:
    """The host's NVIDIA character nodes among NVIDIA_NAMES, in that order: [{name, major, minor}]."""
    out = []
    for name in NVIDIA_NAMES:
        try:
            st = os.stat(f"/dev/{name}")
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode):
            out.append({"name": name, "major": os.major(st.st_rdev), "minor": os.minor(st.st_rdev)})
    return out


FAKE_NODES = [{"name": "nvidia0", "major": 195, "minor": 0}, {"name": "nvidiactl", "major": 195, "minor": 255},
              {"name": "nvidia-uvm", "major": 511, "minor": 0}, {"name": "nvidia-uvm-tools", "major": 511, "minor": 1}]


def nvidia_majors(root: Path = Path("/")) -> set:
    majors = set()
    try:
        section = None
        for line in (root / "proc/devices").read_text().splitlines():
            line = line.strip()
            if line.endswith("devices:"):
                section = line.split()[0]
            elif line and section == "Character":
                number, _, name = line.partition(" ")
                if name.strip().startswith("nvidia"):
                    majors.add(int(number))
    except (OSError, ValueError):
        pass
    return majors


def _get_prog_fd(prog_id: int) -> int:
    from nvsymlinkd.access import bpfprog
    return bpfprog._bpf(bpfprog.BPF_PROG_GET_FD_BY_ID, bpfprog._attr((0, "=I", prog_id)), 12)


def replace_v2_program(cgroup_dir: str, insns: list) -> str:
    """Attach a program of `insns`, then detach every program attached before (what systemd's and
    runc's re-apply do, BPF_F_ALLOW_MULTI: never a moment without a program). -> what was done."""
    from nvsymlinkd.access import bpfeval, bpfprog
    cg = bpfprog.open_cgroup_dir(cgroup_dir)
    try:
        old = bpfprog.query_device_program_ids(cg, effective=False)
        new = bpfprog.load_device_program(bpfeval.encode(insns), name="gpusmoke")
        try:
            bpfprog.attach_device_program(cg, new, bpfprog.BPF_F_ALLOW_MULTI)
        finally:
            os.close(new)
        for prog_id in old:
            fd = _get_prog_fd(prog_id)
            try:
                bpfprog.detach_device_program(cg, fd)
            finally:
                os.close(fd)
        return f"attached a program of {len(insns)} insns, detached {old}"
    finally:
        os.close(cg)


def attached_program(cgroup_dir: str) -> list:
    """The instructions of the one program attached to the cgroup itself (the runtime's)."""
    from nvsymlinkd.access import bpfeval, bpfprog
    cg = bpfprog.open_cgroup_dir(cgroup_dir)
    try:
        ids = bpfprog.query_device_program_ids(cg, effective=False)
    finally:
        os.close(cg)
    if not ids and os.environ.get("GPUSMOKE_V2_ONLY"):
        from tests import bpfasm  # a hybrid host's unified cgroup: no program, no v2 restriction
        return bpfasm.runc_allow_all()
    if len(ids) != 1:
        raise RuntimeError(f"{cgroup_dir} has {len(ids)} device programs attached, expected the runtime's one")
    return bpfeval.decode(bpfprog.read_program(ids[0]).xlated)


def take_nvidia_access(pid: int, majors: set) -> str:
    """Take every NVIDIA device from a running container the way a re-apply without them does:
    v2, a program allowing only systemd's static list (DevicePolicy=closed, no DeviceAllow) replaces
    the runtime's; v1, deny each NVIDIA major."""
    dirs = cgroup_dirs(pid)
    if dirs["devices"]:
        # v1 removes only the exception written exactly so: deny each NVIDIA line devices.list shows
        listed = Path(dirs["devices"], "devices.list").read_text().split("\n")
        gone = []
        for line in listed:
            parts = line.split()
            if len(parts) == 3 and parts[0] == "c" and parts[1].split(":")[0].isdigit() \
                    and int(parts[1].split(":")[0]) in majors:
                with open(os.path.join(dirs["devices"], "devices.deny"), "w") as f:
                    f.write(f"{parts[0]} {parts[1]} rwm\n")
                gone.append(parts[1])
        return f"v1: devices.deny of {gone} in {dirs['devices']}"
    if not dirs["v2"]:
        raise RuntimeError(f"pid {pid} has neither a v1 devices cgroup nor a cgroup2 directory")
    from tests import bpfasm
    return "v2: " + replace_v2_program(dirs["v2"], bpfasm.systemd_program([], policy="closed"))


# --- the fake NVIDIA hook -------------------------------------------------------------------

def hook_main(argv: list) -> int:
    """Run by runc as a prestart hook named nvidia-container-runtime-hook: what libnvidia-container
    does for a container asking for GPUs (NVIDIA_VISIBLE_DEVICES), reduced to its device part:
    grant the nodes in the device cgroup (v1: devices.allow; v2: a program with the NVIDIA blocks
    prepended to the runtime's, attached, the runtime's detached: nvcgo's ebpf.go) and make the nodes
    in the container's /dev (the real hook bind-mounts them). Nodes from $GPUSMOKE_NODES."""
    log_path = os.environ.get("GPUSMOKE_HOOK_LOG")
    try:
        state = json.load(sys.stdin)
        pid = int(state["pid"])
        nodes = json.loads(os.environ["GPUSMOKE_NODES"])
        rootfs = os.path.join(state["bundle"], os.environ.get("GPUSMOKE_ROOTFS", "rootfs"))
        dirs = cgroup_dirs(pid, v2_only=False)
        done = []
        if dirs["devices"]:
            for n in nodes:
                with open(os.path.join(dirs["devices"], "devices.allow"), "w") as f:
                    f.write(f"c {n['major']}:{n['minor']} rw\n")
            done.append("v1 devices.allow")
        if not dirs["devices"] or os.environ.get("GPUSMOKE_V2_ONLY"):
            from nvsymlinkd.host.devices import Rule
            from tests import bpfasm
            old = attached_program(dirs["v2"])
            blocks = [(Rule(True, "c", n["major"], n["minor"], "rw"), True) for n in nodes]
            done.append(replace_v2_program(dirs["v2"], bpfasm.nvidia_prepend(blocks, old)))
        _mknod_in_container(pid, rootfs, nodes)
        done.append(f"mknod {[n['name'] for n in nodes]} under {rootfs}/dev")
        if log_path:
            with open(log_path, "a") as f:
                f.write(f"hook pid {pid}: " + "; ".join(done) + "\n")
        return 0
    except Exception:
        text = traceback.format_exc()
        sys.stderr.write(text)
        if log_path:
            with open(log_path, "a") as f:
                f.write(text)
        return 1


def _mknod_in_container(pid: int, rootfs: str, nodes: list) -> None:
    """In a child: setns into the container's mount namespace (runc has mounted the rootfs and its
    /dev tmpfs there, not yet pivoted), mknod the nodes."""
    child = os.fork()
    if child == 0:
        code = 1
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY)
            if libc.setns(fd, 0x00020000) != 0:  # CLONE_NEWNS
                raise OSError(ctypes.get_errno(), "setns")
            for n in nodes:
                path = os.path.join(rootfs, "dev", n["name"])
                if not os.path.exists(path):
                    os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(n["major"], n["minor"]))
                os.chmod(path, 0o666)
            code = 0
        except BaseException:  # noqa: BLE001 - report, never return into the hook
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"mknod in the container's mount namespace failed (status {status})")


# --- the suite ------------------------------------------------------------------------------

class Suite:
    def __init__(self, args):
        self.args = args
        self.start = time.monotonic()
        self.deadline = self.start + args.budget
        self.obs: Obs = {"meta": {}, "host": {}, "containers": [], "skipped": []}
        self.tag = uuid.uuid4().hex[:6]
        self.work = Path(tempfile.mkdtemp(prefix=f"gpusmoke-{self.tag}-", dir=args.workdir or exec_dir()))
        self.runc_bin = shutil.which(args.runc) or args.runc
        self.containers: List[str] = []
        self.cgroup_parent = f"/gpusmoke-{self.tag}"
        self.smi = shutil.which("nvidia-smi") or ""
        self.inside_python = inside_python()
        self.binds_only: Optional[set] = None  # set once binding every top-level directory failed
        self.env = dict(os.environ)
        path = [str(REPO)] + [p for p in self.env.get("PYTHONPATH", "").split(":") if p]
        self.env["PYTHONPATH"] = ":".join(path)
        self.env["DBUS_SYSTEM_BUS_ADDRESS"] = "unix:path=/nonexistent/gpusmoke-no-bus"
        self.env["NVSYMLINKD_LOG"] = "stderr"
        for k in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "JOURNAL_STREAM"):
            self.env.pop(k, None)
        self.nodes = nvidia_nodes()
        self.fake = False
        self.hroot = Path("/")  # the host steps' --root: a fake tree with --fake-nodes, else the host
        if not self.nodes and args.fake_nodes:
            self.nodes, self.fake = list(FAKE_NODES), True
            self.hroot = self.fake_host()
        self.majors = nvidia_majors(self.hroot) or {n["major"] for n in self.nodes}

    def fake_host(self) -> Path:
        """A host tree with the fake nodes and a /proc/devices naming them (tests/fakehost.py), for the
        host steps (sync, link check, daemon) on a machine without NVIDIA nodes."""
        from tests.fakehost import FakeHost
        host = FakeHost(self.work / "host")
        host.proc_devices({"nvidia-frontend": 195, "nvidia-uvm": 511})
        for n in FAKE_NODES:
            host.node(f"/dev/{n['name']}", n["major"], n["minor"])
        return host.root

    def nvsd_host(self, *args, timeout: float = 60) -> Obs:
        """The CLI for a host step: with --root where the host is a fake tree."""
        root = [] if self.hroot == Path("/") else ["--root", str(self.hroot)]
        return self.nvsd(*root, *args, timeout=timeout)

    # time
    def left(self) -> float:
        return self.deadline - time.monotonic()

    def need(self, seconds: float, what: str) -> bool:
        if self.left() < seconds:
            self.obs["skipped"].append({"name": what, "why": f"out of time ({self.left():.0f} s left of "
                                                                 f"{self.args.budget} s)"})
            log(f"skip {what}: out of time")
            return False
        return True

    # subprocesses
    def sh(self, argv: list, timeout: float = 60, env=None, stdin=None) -> Obs:
        """Run; never raises (except Stop). -> {rc, out, err, error, seconds}."""
        timeout = max(1.0, min(timeout, self.left() - 3))
        t0 = time.monotonic()
        try:
            p = subprocess.run([str(a) for a in argv], input=stdin, capture_output=True, text=True, timeout=timeout,
                               env=env or self.env, stdin=None if stdin is not None else subprocess.DEVNULL)
            res = {"rc": p.returncode, "out": p.stdout, "err": p.stderr, "error": None}
        except subprocess.TimeoutExpired as e:
            res = {"rc": None, "out": _text(e.stdout), "err": _text(e.stderr), "error": f"timed out after {timeout:.0f} s"}
        except OSError as e:
            res = {"rc": None, "out": "", "err": "", "error": f"{argv[0]}: {e}"}
        res["seconds"] = round(time.monotonic() - t0, 3)
        shown = " ".join(str(a) for a in argv)
        if len(shown) > 160:
            shown = shown[:157] + "..."
        log(f"$ {shown} -> rc {res['rc']}{' ' + res['error'] if res['error'] else ''} ({res['seconds']} s)")
        for stream in ("err",):
            text = (res[stream] or "").strip()
            if text:
                print("    " + "\n    ".join(text.splitlines()[-15:]), flush=True)
        return res

    def nvsd(self, *args, timeout: float = 60) -> Obs:
        return self.sh([sys.executable, "-m", "nvsymlinkd", *args], timeout=timeout)

    def runc(self, *args, timeout: float = 60) -> Obs:
        return self.sh([self.runc_bin, "--root", RUNC_ROOT, *args], timeout=timeout)

    # --- step 0: facts ---------------------------------------------------------------
    def facts(self) -> None:
        m = self.obs["meta"]
        m["python"] = sys.version.split()[0]
        m["nvsymlinkd"] = nvsymlinkd_version()
        m["executable"] = sys.executable
        m["kernel"] = os.uname().release
        m["cgroup"] = cgroup_mounts()
        m["nodes"] = self.nodes
        m["fake_nodes"] = self.fake
        m["nvidia_majors"] = sorted(self.majors)
        m["nvidia_smi"] = self.smi or None
        m["inside_python"] = self.inside_python
        r = self.sh([self.runc_bin, "--version"], timeout=20)
        m["runc"] = (r["out"] or r["err"] or r["error"] or "").strip().splitlines()[:1]
        for mod in ("pynvml", "pyudev", "dbus_next", "jinja2"):
            try:
                __import__(mod)
                m[f"have_{mod}"] = True
            except Exception as e:  # noqa: BLE001 - a missing or broken module is a fact
                m[f"have_{mod}"] = f"no: {e}"
        truth = self.probe_host()
        self.obs["meta"]["host_probe"] = truth
        log(f"facts: {json.dumps(m)}")

    def probe_host(self) -> Obs:
        r = self.sh([sys.executable, "-c", PROBE, self.smi], timeout=120)
        return _probe_result(r)

    # --- step 1: sync and the independent link check --------------------------------
    def sync(self) -> None:
        s: Obs = {}
        self.obs["host"]["sync"] = s
        r = self.nvsd_host("sync", timeout=60)
        s["rc"], s["output"] = r["rc"], (r["out"] + r["err"])[-2000:]
        if r["error"]:
            s["error"] = r["error"]
        s["links"] = link_check(self.majors, self.hroot)
        log(f"link check: {s['links']}")

    # --- step 2: check's NVML finding -------------------------------------------------
    def check_nvml(self) -> None:
        n: Obs = {}
        self.obs["host"]["nvml"] = n
        truth = self.obs["meta"].get("host_probe") or {}
        n["truth"] = {"ok": truth.get("nvml") == "ok" if truth.get("nvml") is not None else None,
                      "count": truth.get("nvml_count"), "error": None if truth.get("nvml") == "ok" else truth.get("nvml"),
                      "smi_rc": truth.get("smi_rc"), "cuinit": truth.get("cuinit")}
        r = self.nvsd_host("check", "--json", "--no-bus", timeout=90)
        try:
            doc = json.loads(r["out"])
        except ValueError:
            n["error"] = f"check --json gave no JSON (rc {r['rc']}): {(r['err'] or r['error'] or '')[-300:]}"
            return
        n["check_rc"] = r["rc"]
        n["host_findings"] = doc.get("host")
        n["finding"] = next((h for h in doc.get("host") or [] if h.get("kind") == "nvml"), None)

    # --- step 3: the daemon ------------------------------------------------------------
    def daemon(self) -> None:
        relink: Obs = {"wanted": self.args.tries, "tries": 0, "ms": [], "failures": 0, "timeout_ms": 2000}
        newnode: Obs = {"wanted": self.args.new_nodes, "tries": 0, "ms": [], "removed_ms": [], "failures": 0,
                        "timeout_ms": 2000}
        self.obs["host"]["relink"], self.obs["host"]["newnode"] = relink, newnode
        if not self.nodes:
            relink["error"] = newnode["error"] = "no NVIDIA nodes on this host"
            return
        dev_char = self.hroot / "dev/char"
        daemon = Daemon(self, self.hroot, "daemon")
        watch = None
        made: Optional[Path] = None
        try:
            if not daemon.start():
                relink["error"] = newnode["error"] = "the daemon did not say READY=1 within 30 s"
                return
            watch = LinkWatch(dev_char)
            node = self.nodes[0]
            name = f"{node['major']}:{node['minor']}"
            for _ in range(self.args.tries):
                if self.left() < 30:
                    break
                watch.drain()
                relink["tries"] += 1
                t0 = time.monotonic_ns()
                os.unlink(dev_char / name)
                got = watch.wait_for(name, "create", 2.0)
                if got is None:
                    relink["failures"] += 1
                    continue
                relink["ms"].append((got - t0) / 1e6)
            problem = _link_ok(dev_char / name, node)
            if problem:
                relink.setdefault("problems", []).append(problem)
            minor = _free_minor(node["major"], self.hroot)
            for _ in range(self.args.new_nodes):
                if self.left() < 30 or minor is None:
                    break
                made = self.hroot / (f"dev/nvidia{minor}" if node["major"] == 195 else f"dev/nvidia-gpusmoke{minor}")
                lname = f"{node['major']}:{minor}"
                watch.drain()
                newnode["tries"] += 1
                t0 = time.monotonic_ns()
                os.mknod(made, stat.S_IFCHR | 0o600, os.makedev(node["major"], minor))
                got = watch.wait_for(lname, "create", 2.0)
                if got is None:
                    newnode["failures"] += 1
                else:
                    newnode["ms"].append((got - t0) / 1e6)
                    problem = _link_ok(dev_char / lname, {"major": node["major"], "minor": minor})
                    if problem:
                        newnode.setdefault("problems", []).append(problem)
                t0 = time.monotonic_ns()
                made.unlink()
                made = None
                got = watch.wait_for(lname, "delete", 2.0)
                if got is None:
                    newnode["failures"] += 1
                    newnode.setdefault("problems", []).append(f"/dev/char/{lname} not removed with its node")
                else:
                    newnode["removed_ms"].append((got - t0) / 1e6)
        finally:
            if made is not None:
                _quiet_unlink(made)
            if watch is not None:
                watch.close()
            rc, text = daemon.stop()
            relink["daemon_rc"] = rc
            relink["daemon_log_tail"] = text[-3000:]
            if rc not in (None, 0, -15):
                relink.setdefault("problems", []).append(f"the daemon exited {rc} on SIGTERM")
        # the daemon's repair = auto must not be running while containers lose devices: it is stopped

    # --- step 4: containers ---------------------------------------------------------------
    def scenarios(self) -> list:
        by = {n["name"]: n for n in self.nodes}
        gpu = [by[k] for k in NVIDIA_NAMES if k in by]
        no_uvm = [n for n in gpu if not n["name"].startswith("nvidia-uvm")]
        return [
            {"name": "a-healthy", "nodes": gpu, "rules": gpu, "expect": {"verdict": "ok", "inside": judge.WORKS,
                                                                        "repair": judge.NOTHING}},
            {"name": "b-no-uvm", "nodes": no_uvm, "rules": no_uvm,
             "expect": {"verdict": "at-risk-uvm-missing", "inside": judge.NO_CUDA, "repair": judge.NOT_REPAIRED}},
            {"name": "c-never-allowed", "nodes": gpu, "rules": [],
             "expect": {"verdict": "denied", "inside": judge.FAILS, "repair": judge.NOT_REPAIRED}},
            {"name": "d-replaced", "nodes": gpu, "rules": gpu, "take": True,
             "expect": {"verdict": "lost", "inside": judge.FAILS, "repair": judge.REPAIRED}},
            {"name": "e-hook-lost", "nodes": [], "rules": [], "hook": gpu, "take": True,
             "env": ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"],
             "expect": {"verdict": "lost", "inside": judge.FAILS, "repair": judge.REPAIRED}},
            {"name": "f-daemon-first-pass", "nodes": [], "rules": [], "hook": gpu, "take": True, "by_daemon": True,
             "env": ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"],
             "expect": {"verdict": "lost", "inside": judge.FAILS, "repair": judge.REPAIRED}},
        ]

    def bundle(self, sc: dict, cid: str, binds_only: Optional[set] = None) -> Path:
        """A runc bundle: `runc spec`, then the host's top-level directories bound read-only, a tmpfs
        on /tmp, the scenario's devices, rules, env and hook."""
        bundle = self.work / "bundles" / cid
        if bundle.exists():
            shutil.rmtree(bundle)
        rootfs = bundle / "rootfs"
        rootfs.mkdir(parents=True)
        r = self.sh([self.runc_bin, "spec", "--bundle", bundle], timeout=20)
        if r["rc"] != 0:
            raise RuntimeError(f"runc spec failed: {r['err'] or r['error']}")
        spec = json.loads((bundle / "config.json").read_text())
        spec = patch_spec(spec, sc, cid, self.cgroup_parent, self.hook_path() if sc.get("hook") else None,
                          sc.get("hook") and self.hook_env(sc["hook"]), binds_only)
        for name, target in host_top_links():
            os.symlink(target, rootfs / name)
        (bundle / "config.json").write_text(json.dumps(spec, indent=1))
        return bundle

    def hook_path(self) -> str:
        path = self.work / "bin" / HOOK_NAME
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            # the checkout comes on PYTHONPATH with the hook's env (hook_env). nvsymlinkd trusts at the hook's
            # path only a binary or the toolkit installer's wrapper (containers/hookgrant.py parse_wrapper), and
            # reads the toolkit's version from the binary's build info: the fake is the wrapper's .real and
            # carries the linker flag a 1.17.8 build has
            real = path.with_name(HOOK_NAME + ".real")
            real.write_text(f"#!{sys.executable}\nimport sys\n"
                            "# -X github.com/NVIDIA/nvidia-container-toolkit/internal/info.version=1.17.8\n"
                            "from tests.gpu import smoke\nsys.exit(smoke.hook_main(sys.argv))\n")
            real.chmod(0o755)
            path.write_text(f"#! /bin/sh\nPATH=/usr/sbin:/usr/bin:/sbin:/bin \\\n\t{real} \\\n\t\t\"$@\"\n")
            path.chmod(0o755)
        return str(path)

    def hook_env(self, nodes: list) -> list:
        env = [f"GPUSMOKE_NODES={json.dumps(nodes)}", f"GPUSMOKE_HOOK_LOG={self.work / 'hook.log'}",
               f"PYTHONPATH={self.env['PYTHONPATH']}", "PATH=/usr/sbin:/usr/bin:/sbin:/bin"]
        if os.environ.get("GPUSMOKE_V2_ONLY"):
            env.append(f"GPUSMOKE_V2_ONLY={os.environ['GPUSMOKE_V2_ONLY']}")
        return env

    def container(self, sc: dict) -> None:
        cid = f"gpusmoke-{sc['name']}-{self.tag}"
        c: Obs = {"name": sc["name"], "id": cid, "expect": sc["expect"], "steps": []}
        self.obs["containers"].append(c)
        started = time.monotonic()
        try:
            self.containers.append(cid)
            rc, text = self.run_container(sc, cid, None)
            if rc != 0 and self.binds_only is None:
                # binding every top-level directory failed? once more with the essential ones only,
                # and so for the following scenarios
                self.delete(cid)
                self.containers.append(cid)
                essential = set(ESSENTIAL) | top_dirs_of(self.inside_python, self.smi, sys.executable)
                rc2, text2 = self.run_container(sc, cid, essential)
                if rc2 == 0:
                    self.binds_only = essential
                    c["steps"].append(f"binding every top-level directory failed ({text[-200:]}); "
                                      f"bound only {sorted(essential)}")
                rc, text = rc2, text2
            if rc != 0:
                hook_log = self.work / "hook.log"
                extra = hook_log.read_text()[-800:] if hook_log.exists() else ""
                raise RuntimeError(f"runc run failed (rc {rc}): {text[-400:]} {extra}")
            pid = json.loads((Path(RUNC_ROOT) / cid / "state.json").read_text())["init_process_pid"]
            c["pid"] = pid
            if sc.get("take"):
                c["before"] = self.probe_inside(cid)
                c["before_check"] = self.check(cid)
                c["steps"].append(take_nvidia_access(pid, self.majors))
                log(f"{cid}: {c['steps'][-1]}")
            c["inside"] = self.probe_inside(cid)
            c["check"] = self.check(cid)
            if sc.get("by_daemon"):
                c["repair"] = self.daemon_repair(cid)
            else:
                c["dry_run"] = self.repair(cid, dry=True)
                c["repair"] = self.repair(cid)
            c["after"] = self.probe_inside(cid)
            c["after_check"] = self.check(cid)
            c["seconds"] = round(time.monotonic() - started, 1)
            self.delete(cid)  # judged: the next scenario's daemon (repair = "auto") must not touch it
        except Stop:
            raise
        except Exception as e:  # noqa: BLE001 - one scenario's failure is its row's ERROR
            c["error"] = f"{type(e).__name__}: {e}"
            log(f"{cid}: ERROR {c['error']}\n{traceback.format_exc()}")

    def daemon_repair(self, cid: str) -> Obs:
        """Start the daemon after the loss (nothing was watching when it happened): its first pass
        verifies the container and, repair = "auto", gives the devices back. -> the repair it logged."""
        res: Obs = {"rc": None, "status": None, "text": "", "error": None, "by": "daemon"}
        daemon = Daemon(self, Path("/"), f"daemon-{cid}", debug=True)
        try:
            if not daemon.start():  # slow (a loaded VM) or dead: what it says about the container decides
                res["notes"] = ["the daemon did not say READY=1 within 30 s"]
                if daemon.proc is None or daemon.proc.poll() is not None:
                    res["error"] = "the daemon exited before READY=1: " + daemon.text()[-300:]
                    return res
            end = time.monotonic() + 30
            quiet_since = None  # it verified the containers and said nothing about this one since
            while time.monotonic() < end and res["status"] is None:
                text = daemon.text()
                if "verified " in text and " GPU containers" in text and cid not in text.rpartition("verified ")[2]:
                    quiet_since = quiet_since or time.monotonic()
                    if time.monotonic() - quiet_since > 5:
                        break
                else:
                    quiet_since = None
                for line in text.splitlines():
                    if cid not in line:
                        continue
                    for words, status in (("verified: repaired", "repaired"), ("verified: failed", "failed"),
                                          ("cannot repair automatically", "cannot-repair"), ("FAILED", "failed")):
                        if words in line:
                            res["status"] = status
                            res["text"] = line.strip()[:400]
                            break
                time.sleep(0.2)
            if res["status"] is None:
                said = [line for line in daemon.text().splitlines() if cid in line]
                res["text"] = " | ".join(said)[-400:] or "the daemon's first pass said nothing about the container"
        finally:
            daemon.stop()
        log(f"daemon's first pass for {cid}: {res['status']} {res['text'][:300]}")
        return res

    def delete(self, cid: str) -> None:
        self.runc("kill", cid, "KILL", timeout=20)
        for _ in range(20):
            r = self.runc("delete", "-f", cid, timeout=20)
            if r["rc"] == 0 or "not exist" in (r["err"] or ""):
                if cid in self.containers:
                    self.containers.remove(cid)
                return
            time.sleep(0.2)

    def run_container(self, sc: dict, cid: str, binds_only: Optional[set]) -> tuple:
        """`runc run -d`; -> (exit status or None on a timeout, what runc said)."""
        bundle = self.bundle(sc, cid, binds_only if binds_only is not None else self.binds_only)
        with open(bundle / "runc.log", "w+") as out:
            t0 = time.monotonic()
            try:
                p = subprocess.run([self.runc_bin, "--root", RUNC_ROOT, "run", "-d", "--bundle", str(bundle), cid],
                                   stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                   timeout=max(5, min(60, self.left() - 3)), env=self.env)
                rc = p.returncode
            except subprocess.TimeoutExpired:
                rc = None
            out.seek(0)
            text = out.read().strip()
        log(f"runc run {cid}: rc {rc} ({time.monotonic() - t0:.2f} s) {text[-500:]}")
        return rc, text

    def probe_inside(self, cid: str) -> Obs:
        cuda = (self.obs["meta"].get("host_probe") or {}).get("libcuda") or ""
        r = self.runc("exec", "--env", "HOME=/tmp", cid, self.inside_python, "-c", PROBE, self.smi, cuda, timeout=150)
        res = _probe_result(r)
        log(f"{cid} inside: {json.dumps(res)[:600]}")
        return res

    def check(self, cid: str) -> Obs:
        r = self.nvsd("check", "--json", "--no-host", "--no-bus", cid, timeout=60)
        res: Obs = {"rc": r["rc"], "verdict": None, "kinds": [], "devices": [], "error": r["error"]}
        try:
            doc = json.loads(r["out"])
            (ctr,) = [x for x in doc.get("containers") or [] if x.get("id") == cid] or [None]
        except ValueError:
            res["error"] = f"no JSON (rc {r['rc']}): {(r['err'] or r['out'])[-300:]}"
            return res
        if ctr is None:
            res["error"] = f"{cid} not among check's containers (rc {r['rc']}): {r['err'][-300:]}"
            res["summary"] = doc.get("summary")
            return res
        res["verdict"] = ctr.get("verdict")
        res["kinds"] = [f.get("kind") for f in ctr.get("findings") or []]
        res["devices"] = sorted({d for f in ctr.get("findings") or [] for d in f.get("devices") or []})
        res["findings"] = ctr.get("findings")
        res["expected"] = ctr.get("expected")
        res["untrusted_nodes"] = ctr.get("untrusted_nodes")
        log(f"check {cid}: {res['verdict']} {res['kinds']} {res['devices']} (rc {res['rc']})")
        return res

    def repair(self, cid: str, dry: bool = False) -> Obs:
        args = ["repair", "--json"] + (["--dry-run"] if dry else []) + [cid]
        r = self.nvsd(*args, timeout=90)
        res: Obs = {"rc": r["rc"], "status": None, "text": "", "error": r["error"]}
        try:
            doc = json.loads(r["out"])
        except ValueError:
            res["error"] = res["error"] or f"no JSON (rc {r['rc']}): {(r['err'] or r['out'])[-300:]}"
            res["text"] = (r["err"] or r["out"])[-500:]
            return res
        entries = [x for x in doc.get("containers") or [] if x.get("container") == cid]
        unknown = [x for x in doc.get("unknown") or [] if x.get("container") == cid]
        if entries:
            e = entries[0]
            res["status"] = e.get("status")
            res["text"] = e.get("cannot") or e.get("error") or "; ".join(e.get("steps") or [])
            res["mechanism"] = e.get("mechanism")
            res["steps"] = e.get("steps")
            res["refused"] = e.get("refused")
        elif unknown:
            res["status"] = "unknown"
            res["text"] = unknown[0].get("reason") or ""
        else:  # another list naming it (e.g. "denied": never repaired, nothing trusted granted them)
            for key, value in doc.items():
                if key not in ("containers", "unknown", "thawed") and isinstance(value, list):
                    named = [x for x in value if isinstance(x, dict) and x.get("container") == cid]
                    if named:
                        res["status"] = key
                        res["text"] = str(named[0].get("detail") or named[0].get("reason") or "")
                        break
        res["summary"] = doc.get("summary")
        log(f"repair{' --dry-run' if dry else ''} {cid}: {res['status']} (rc {res['rc']}) {res['text'][:300]}")
        return res

    # --- cleanup -----------------------------------------------------------------------------
    def cleanup(self) -> None:
        for cid in self.containers:
            try:
                subprocess.run([self.runc_bin, "--root", RUNC_ROOT, "kill", cid, "KILL"], capture_output=True, timeout=20)
            except (OSError, subprocess.SubprocessError) as e:
                log(f"cleanup: runc kill {cid}: {e}")
        for cid in self.containers:
            for _ in range(20):
                try:
                    p = subprocess.run([self.runc_bin, "--root", RUNC_ROOT, "delete", "-f", cid], capture_output=True,
                                       text=True, timeout=20)
                except (OSError, subprocess.SubprocessError) as e:
                    log(f"cleanup: runc delete {cid}: {e}")
                    break
                if p.returncode == 0 or "does not exist" in p.stderr or "not exist" in p.stderr:
                    break
                time.sleep(0.2)
        mounts = cgroup_mounts()
        for top in (mounts["v2"], mounts["devices"]):
            if top:
                _rmtree_cgroup(Path(top) / self.cgroup_parent.lstrip("/"))
        if mounts["devices"]:  # hybrid/v1: runc made the parent in every controller
            base = Path(mounts["devices"]).parent
            try:
                for ctrl in os.listdir(base):
                    _rmtree_cgroup(base / ctrl / self.cgroup_parent.lstrip("/"))
            except OSError:
                pass
        if not self.args.keep:
            shutil.rmtree(self.work, ignore_errors=True)

    # --- all -------------------------------------------------------------------------------------
    def run(self) -> int:
        steps = [("facts", self.facts, 10), ("sync", self.sync, 20), ("check nvml", self.check_nvml, 20),
                 ("daemon", self.daemon, 40)]
        try:
            for name, fn, need in steps:
                if name in self.args.skip or not self.need(need, name):
                    continue
                self._guard(name, fn)
            # the ones issues 24 and 28 are about before the uvm case, should the budget run short
            order = {"a": 0, "c": 1, "d": 2, "e": 3, "f": 4, "b": 5}
            for sc in sorted(self.scenarios(), key=lambda sc: order.get(sc["name"][0], 9)):
                if sc["name"] in self.args.skip or sc["name"][0] in self.args.skip:
                    continue
                if self.need(45, sc["name"]):
                    self.container(sc)
        except Stop as e:
            self.obs["fatal"] = str(e)
            log(f"stopping: {e}")
        finally:
            # the cleanup and the table are not interrupted (run.sh's timeout -k still ends all 20 s later)
            for sig in (signal.SIGTERM, signal.SIGINT):
                try:
                    signal.signal(sig, signal.SIG_IGN)
                except ValueError:  # not the main thread (a test calling run())
                    pass
            try:
                self.cleanup()
            except Stop as e:
                self.obs["fatal"] = str(e)
            except Exception as e:  # noqa: BLE001
                log(f"cleanup failed: {e!r}")
        return self.report()

    def _guard(self, name: str, fn) -> None:
        try:
            fn()
        except Stop:
            raise
        except Exception as e:  # noqa: BLE001 - a failing step is an ERROR row
            log(f"step {name} failed: {e!r}\n{traceback.format_exc()}")
            key = {"sync": "sync", "check nvml": "nvml", "daemon": "relink"}.get(name)
            if key:
                self.obs["host"].setdefault(key, {})["error"] = f"{type(e).__name__}: {e}"
            else:
                self.obs.setdefault("step_errors", []).append(f"{name}: {e!r}")

    def report(self) -> int:
        self.obs["meta"]["seconds"] = round(time.monotonic() - self.start, 1)
        try:
            result = judge.judge_all(self.obs)
            table, code = result["table"], result["exit"]
            self.obs["judgement"] = [{"outcome": r["outcome"], "cells": r["cells"], "reasons": r["reasons"],
                                      "errors": r["errors"]} for r in result["rows"]]
        except Exception:  # noqa: BLE001 - the table must come out
            table, code = "judge failed:\n" + traceback.format_exc(), 2
        for e in self.obs.get("step_errors") or []:
            table += f"\nstep error: {e}"
        table += (f"\nexit {code}; {self.obs['meta']['seconds']} s; tag {self.tag}; nvsymlinkd "
                  f"{self.obs['meta'].get('nvsymlinkd') or nvsymlinkd_version()}; runc "
                  f"{' '.join(self.obs['meta'].get('runc') or ['?'])}; kernel {os.uname().release}")
        host = self.obs["meta"].get("host_probe") or {}
        if host.get("smi_rc") is not None:
            table += f"\nhost: nvidia-smi -L rc {host.get('smi_rc')}: {(host.get('smi_text') or '').strip()[:200]}"
        out = self.args.out
        if out:
            try:
                Path(out).mkdir(parents=True, exist_ok=True)
                (Path(out) / "gpu-smoke.json").write_text(json.dumps(self.obs, indent=1, default=str))
                (Path(out) / "gpu-smoke-table.txt").write_text(table + "\n")
            except OSError as e:
                table += f"\ncannot write to {out}: {e}"
        print("\n" + "=" * 30 + " GPU smoke table " + "=" * 30)
        print(table, flush=True)
        return code


def _text(v) -> str:
    if v is None:
        return ""
    return v.decode(errors="replace") if isinstance(v, bytes) else v


def _probe_result(r: Obs) -> Obs:
    lines = [line for line in (r.get("out") or "").splitlines() if line.startswith("{")]
    if not lines:
        return {"error": r.get("error") or f"no probe output (rc {r.get('rc')}): {(r.get('err') or '')[-400:]}"}
    try:
        return json.loads(lines[-1])
    except ValueError as e:
        return {"error": f"probe output is not JSON: {e}"}


def nvsymlinkd_version() -> str:
    """The package version, and the checkout's commit where git and .git are there."""
    try:
        import nvsymlinkd
        version = str(nvsymlinkd.__version__)
    except Exception as e:  # noqa: BLE001
        version = f"? ({e})"
    try:
        head = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%h %s"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode == 0 and head.stdout.strip():
            version += f" ({head.stdout.strip()[:70]})"
    except (OSError, subprocess.SubprocessError):
        pass
    return version


def exec_dir() -> str:
    """A temp directory whose file system lets runc execute the hook stand-in written there (not noexec)."""
    noexec = getattr(os, "ST_NOEXEC", 8)
    for d in (tempfile.gettempdir(), "/var/tmp", "/root", str(REPO)):
        try:
            if os.path.isdir(d) and os.access(d, os.W_OK) and not os.statvfs(d).f_flag & noexec:
                return d
        except OSError:
            continue
    return tempfile.gettempdir()


def top_dirs_of(*paths: str) -> set:
    """The top-level directory names of these paths and of what they resolve to."""
    out = set()
    for path in paths:
        for p in (os.path.abspath(path), os.path.realpath(path)) if path else ():
            parts = Path(p).parts
            if len(parts) > 1:
                out.add(parts[1])
    return out


def visible_inside(path: str) -> bool:
    """Whether a host path is there in the suite's containers (they bind every top-level directory
    but NOT_BOUND), itself and what it resolves to."""
    for p in (os.path.abspath(path), os.path.realpath(path)):
        parts = Path(p).parts
        if len(parts) < 2 or parts[1] in NOT_BOUND:
            return False
    return True


def inside_python() -> str:
    """The interpreter the probe runs with inside: this one (its pynvml) where the container sees it."""
    for candidate in (sys.executable, shutil.which("python3") or "", "/usr/bin/python3"):
        if candidate and visible_inside(candidate) and os.path.exists(candidate):
            return candidate
    return sys.executable


def host_top_links() -> list:
    """The host's top-level symlinks (usrmerge: bin -> usr/bin), made in the rootfs as they are."""
    out = []
    for name in sorted(os.listdir("/")):
        p = os.path.join("/", name)
        if os.path.islink(p) and name not in NOT_BOUND:
            out.append((name, os.readlink(p)))
    return out


# the fallback when binding every top-level directory fails (one runc cannot bind, e.g. a FUSE mount)
ESSENTIAL = ("usr", "etc", "opt", "lib", "lib32", "lib64", "libx32", "bin", "sbin", "root", "var")


def host_binds(only: Optional[set] = None) -> list:
    """A read-only recursive bind of each top-level host directory but /proc, /sys, /dev, /tmp, /run
    (only: of these names)."""
    out = []
    for name in sorted(os.listdir("/")):
        p = os.path.join("/", name)
        if name in NOT_BOUND or os.path.islink(p) or not os.path.isdir(p) or (only is not None and name not in only):
            continue
        out.append({"destination": p, "type": "bind", "source": p, "options": ["rbind", "ro", "nosuid"]})
    if only is None and os.environ.get("GPUSMOKE_TEST_BAD_BIND"):  # tests: a bind runc cannot make
        out.append({"destination": "/gpusmoke-bad", "type": "bind", "source": "/nonexistent-gpusmoke-bind",
                    "options": ["rbind", "ro"]})
    return out


def _rule(n: dict, access: str = "rwm") -> dict:
    return {"allow": True, "type": "c", "major": n["major"], "minor": n["minor"], "access": access}


def _node(n: dict) -> dict:
    return {"path": f"/dev/{n['name']}", "type": "c", "major": n["major"], "minor": n["minor"],
            "fileMode": 0o666, "uid": 0, "gid": 0}


def patch_spec(spec: dict, sc: dict, cid: str, cgroup_parent: str, hook_path: Optional[str],
               hook_env, binds_only: Optional[set] = None) -> dict:
    """`runc spec`'s default made into the scenario's container (pure but for host_binds())."""
    proc = spec["process"]
    proc["terminal"] = False
    proc["args"] = [shutil.which("sleep") or "/bin/sleep", "100000"]
    proc["env"] = [e for e in proc.get("env") or [] if not e.startswith("PATH=")]
    proc["env"] += ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/tmp"]
    proc["env"] += list(sc.get("env") or [])
    spec["hostname"] = cid[:63]
    spec["root"] = {"path": "rootfs", "readonly": False}
    mounts = [m for m in spec.get("mounts") or [] if m.get("destination") != "/tmp"]
    spec["mounts"] = host_binds(binds_only) + mounts + [
        {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev", "mode=1777"]}]
    linux = spec.setdefault("linux", {})
    linux["cgroupsPath"] = f"{cgroup_parent}/{cid}"
    linux["devices"] = [_node(n) for n in sc.get("nodes") or []]
    res = linux.setdefault("resources", {})
    res["devices"] = list(res.get("devices") or [{"allow": False, "access": "rwm"}]) + [_rule(n) for n in sc.get("rules") or []]
    if hook_path:
        spec["hooks"] = {"prestart": [{"path": hook_path, "args": [HOOK_NAME, "prestart"], "env": list(hook_env or []),
                                       "timeout": 60}]}
    return spec


def link_check(majors: set, root: Path = Path("/")) -> Obs:
    """Independent of nvsymlinkd: every /dev/char/M:m with an NVIDIA major resolves to a node whose
    st_rdev is M:m, and every NVIDIA node under /dev has its link."""
    problems, nodes, exact = [], 0, 0
    seen = set()
    dev = root / "dev"
    candidates = []
    for sub in ("", "nvidia-caps", "nvidia-caps-imex-channels"):
        d = dev / sub if sub else dev
        try:
            names = sorted(os.listdir(d))
        except OSError:
            continue
        for name in names:
            if sub or name.startswith("nvidia"):
                candidates.append(d / name)
    for p in candidates:
        try:
            st = os.lstat(p)
        except OSError:
            continue
        if not stat.S_ISCHR(st.st_mode) or os.major(st.st_rdev) not in majors:
            continue
        if st.st_rdev in seen:
            continue
        seen.add(st.st_rdev)
        nodes += 1
        name = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
        problem = _link_ok(dev / "char" / name, {"major": os.major(st.st_rdev), "minor": os.minor(st.st_rdev)})
        if problem:
            problems.append(f"{p}: {problem}")
        else:
            exact += 1
    try:
        entries = sorted(os.listdir(dev / "char"))
    except OSError as e:
        entries = []
        problems.append(f"/dev/char: {e}")
    for name in entries:
        major, _, minor = name.partition(":")
        if not (major.isdigit() and minor.isdigit()) or int(major) not in majors:
            continue
        problem = _link_ok(dev / "char" / name, {"major": int(major), "minor": int(minor)})
        if problem:
            problems.append(problem)
    return {"nodes": nodes, "exact": exact, "problems": sorted(set(problems))}


def _link_ok(link: Path, node: dict) -> Optional[str]:
    try:
        if not os.path.islink(link):
            return f"{link} is not a symlink" if os.path.lexists(link) else f"{link} missing"
        st = os.stat(link)
    except OSError as e:
        return f"{link} -> {os.readlink(link) if os.path.islink(link) else '?'}: {e.strerror}"
    if not stat.S_ISCHR(st.st_mode) or st.st_rdev != os.makedev(node["major"], node["minor"]):
        return f"{link} resolves to {os.major(st.st_rdev)}:{os.minor(st.st_rdev)}, not {node['major']}:{node['minor']}"
    return None


def _free_minor(major: int, root: Path = Path("/")) -> Optional[int]:
    used = set()
    for base in (root / "dev", root / "dev/char"):
        try:
            for name in os.listdir(base):
                try:
                    st = os.stat(os.path.join(base, name))
                except OSError:
                    continue
                if stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == major:
                    used.add(os.minor(st.st_rdev))
        except OSError:
            pass
    for minor in range(200, 250):
        if minor not in used and not os.path.lexists(root / f"dev/nvidia{minor}"):
            return minor
    return None


def _quiet_unlink(p: Path) -> None:
    try:
        p.unlink()
    except OSError:
        pass


def _rmtree_cgroup(top: Path) -> None:
    if not top.is_dir():
        return
    for leaf in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        _rmdir(leaf)
    _rmdir(top)


def _rmdir(path: Path) -> None:
    for _ in range(50):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.05)


class Daemon:
    """`nvsymlinkd [--root R] run --resync-interval 0` as a subprocess, READY=1 awaited on a notify
    socket of our own, its stderr in WORK/NAME.log."""

    def __init__(self, suite: Suite, root: Path, name: str, debug: bool = False):
        self.suite, self.root, self.name, self.debug = suite, root, name, debug
        self.proc: Optional[subprocess.Popen] = None
        self.notify: Optional[socket.socket] = None
        self.log_path = suite.work / f"{name}.log"

    def start(self, timeout: float = 30) -> bool:
        sock_path = self.suite.work / f"{self.name}.notify"
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(sock_path))
        env = dict(self.suite.env, NOTIFY_SOCKET=str(sock_path))
        if self.debug:
            env["NVSYMLINKD_DEBUG"] = "1"  # "verified N GPU containers ...": when its first look is done
        root = [] if self.root == Path("/") else ["--root", str(self.root)]
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "nvsymlinkd", *root, "run", "--resync-interval", "0"],
                                         env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        return _wait_ready(self.notify, self.proc, min(timeout, max(1.0, self.suite.left() - 5)))

    def text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> tuple:
        """SIGTERM (SIGKILL after 10 s); -> (exit status or None, what it said)."""
        rc = None
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
            rc = self.proc.returncode
        if self.notify is not None:
            self.notify.close()
        text = self.text()
        log(f"{self.name} said:\n    " + "\n    ".join(text.strip().splitlines()[-20:]))
        return rc, text


def _wait_ready(sock: socket.socket, proc, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            return False
        ready, _, _ = select.select([sock], [], [], 0.2)
        if ready:
            data = sock.recv(4096).decode(errors="replace")
            if "READY=1" in data.splitlines():
                return True
    return False


IN_CREATE, IN_DELETE, IN_MOVED_TO = 0x100, 0x200, 0x80


class LinkWatch:
    """inotify on /dev/char: when was NAME created (or deleted)? CLOCK_MONOTONIC ns."""

    def __init__(self, path: Path):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        if self.libc.inotify_add_watch(self.fd, str(path).encode(), IN_CREATE | IN_DELETE | IN_MOVED_TO) < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {path}")

    def _events(self) -> list:
        try:
            buf = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return []
        out, off = [], 0
        while off + 16 <= len(buf):
            _wd, mask, _cookie, length = (int.from_bytes(buf[off + i:off + i + 4], sys.byteorder) for i in (0, 4, 8, 12))
            name = buf[off + 16:off + 16 + length].split(b"\0", 1)[0].decode(errors="replace")
            out.append((mask, name))
            off += 16 + length
        return out

    def drain(self) -> None:
        while self._events():
            pass

    def wait_for(self, name: str, what: str, timeout: float) -> Optional[int]:
        want = IN_DELETE if what == "delete" else (IN_CREATE | IN_MOVED_TO)
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.fd], [], [], left)
            now = time.monotonic_ns()
            if ready:
                for mask, got in self._events():
                    if got == name and mask & want:
                        return now

    def close(self) -> None:
        os.close(self.fd)


# --- self-check: no GPU needed ------------------------------------------------------------------

def self_check(args) -> int:
    """What can go wrong before the GPU run: imports, the carried runc, the specs, the BPF programs,
    the judge. Prints one line per item; exit 1 if any failed."""
    results = []

    def item(name, fn):
        try:
            detail = fn()
            results.append((name, "ok", str(detail or "")))
        except Exception as e:  # noqa: BLE001
            results.append((name, "FAIL", f"{type(e).__name__}: {e}"))

    def imports():
        import nvsymlinkd.cli  # noqa: F401
        from nvsymlinkd.access import bpfeval, bpfprog  # noqa: F401
        from tests import bpfasm  # noqa: F401
        have = []
        for mod in ("pyudev", "dbus_next", "jinja2", "pynvml"):
            try:
                __import__(mod)
                have.append(mod)
            except Exception:  # noqa: BLE001
                have.append(f"no {mod}")
        return ", ".join(have)

    def cli():
        p = subprocess.run([sys.executable, "-m", "nvsymlinkd", "check", "--help"], capture_output=True, text=True,
                           timeout=60, env=dict(os.environ, PYTHONPATH=":".join([str(REPO), os.environ.get("PYTHONPATH", "")])))
        if p.returncode != 0:
            raise RuntimeError(p.stderr.strip()[-300:])
        return "nvsymlinkd check --help rc 0"

    def runc_version():
        p = subprocess.run([shutil.which(args.runc) or args.runc, "--version"], capture_output=True, text=True, timeout=20)
        if p.returncode != 0:
            raise RuntimeError(f"rc {p.returncode}: {p.stderr.strip()}")
        return p.stdout.splitlines()[0]

    def specs():
        s = Suite.__new__(Suite)
        s.args = args
        s.nodes = nvidia_nodes() or list(FAKE_NODES)
        s.work = Path(tempfile.mkdtemp(prefix="gpusmoke-selfcheck-"))
        s.env = dict(os.environ, PYTHONPATH=str(REPO))
        s.cgroup_parent = "/gpusmoke-selfcheck"
        s.runc_bin = shutil.which(args.runc) or args.runc
        s.deadline = time.monotonic() + 120
        s.binds_only = None
        s.inside_python = inside_python()
        s.smi = shutil.which("nvidia-smi") or ""
        try:
            names = []
            for sc in s.scenarios():
                bundle = s.bundle(sc, f"gpusmoke-{sc['name']}-selfcheck")
                spec = json.loads((bundle / "config.json").read_text())
                assert spec["linux"]["cgroupsPath"].startswith("/gpusmoke-selfcheck/")
                assert os.path.exists(spec["process"]["args"][0]), spec["process"]["args"][0]
                assert any(m["destination"] == "/tmp" and m["type"] == "tmpfs" for m in spec["mounts"])
                if sc.get("hook"):
                    hook = spec["hooks"]["prestart"][0]
                    assert os.access(hook["path"], os.X_OK)
                    real = hook["path"] + ".real"  # the path is the installer-shaped wrapper around it
                    assert os.access(real, os.X_OK)
                    compile(Path(real).read_text(), real, "exec")
                names.append(sc["name"])
            return f"{len(names)} bundles: " + ", ".join(names)
        finally:
            shutil.rmtree(s.work, ignore_errors=True)

    def bpf():
        from nvsymlinkd.access import bpfeval, bpfprog
        from nvsymlinkd.host.devices import Rule
        from tests import bpfasm
        prog = bpfasm.systemd_program([], policy="closed")
        hooked = bpfasm.nvidia_prepend([(Rule(True, "c", 195, 0, "rw"), True)], bpfasm.runc_program([], False))
        for insns in (prog, hooked):
            fd = bpfprog.load_device_program(bpfeval.encode(insns))
            os.close(fd)
        return "the kernel loads the replacement and the hook's programs"

    def probe():
        p = subprocess.run([sys.executable, "-c", PROBE, shutil.which("nvidia-smi") or ""], capture_output=True,
                           text=True, timeout=120)
        return _probe_result({"out": p.stdout, "err": p.stderr, "rc": p.returncode})

    def judged():
        sample = {"containers": [{"name": "x", "expect": {"verdict": "ok"}, "inside": {"smi_rc": 255, "nvml": "Unknown Error",
                                                                                         "cuinit": 100},
                                  "check": {"verdict": "ok", "rc": 0}}]}
        result = judge.judge_all(sample)
        assert result["exit"] == 1, result
        return "a container that cannot open its GPUs but is ok is a disagreement"

    item("imports", imports)
    item("nvsymlinkd CLI", cli)
    item("runc", runc_version)
    item("bundles", specs)
    item("cgroup mounts", lambda: json.dumps(cgroup_mounts()))
    item("BPF programs", bpf)
    item("probe (host)", probe)
    item("judge", judged)
    width = max(len(n) for n, _, _ in results)
    for name, status, detail in results:
        print(f"{name.ljust(width)}  {status:4}  {detail[:300]}")
    failed = [n for n, s, _ in results if s != "ok"]
    print(f"self-check: {len(results) - len(failed)} ok, {len(failed)} failed")
    return 1 if failed else 0


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="see docs/testing.md, 'The GPU smoke suite'")
    ap.add_argument("--out", default=os.environ.get("OUT") or None, help="write gpu-smoke.json and gpu-smoke-table.txt here (default $OUT)")
    ap.add_argument("--budget", type=float, default=300, help="seconds for the whole run (default 300)")
    ap.add_argument("--runc", default="runc", help="runc binary (default: runc on PATH)")
    ap.add_argument("--tries", type=int, default=20, help="daemon relink rounds (default 20)")
    ap.add_argument("--new-nodes", type=int, default=20, help="daemon new-node rounds (default 20)")
    ap.add_argument("--skip", action="append", default=[], help="skip a step (facts, sync, check nvml, daemon) or a "
                                                                 "scenario (a-healthy or its letter); repeatable")
    ap.add_argument("--workdir", default=None, help="where bundles go (default: the system's temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (bundles, logs)")
    ap.add_argument("--fake-nodes", action="store_true",
                    help="no NVIDIA nodes on this host: give the containers fake ones (195:0, 195:255, 511:0, 511:1; "
                         "inside, open() decides), to exercise the suite itself")
    ap.add_argument("--self-check", action="store_true", help="check imports, runc, bundles, BPF, the judge; no GPU")
    args = ap.parse_args(argv)
    if args.self_check:
        return self_check(args)
    if os.geteuid() != 0:
        print("smoke.py: needs root (runc, cgroups, mknod); --self-check runs without", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        suite = Suite(args)
    except Exception:  # noqa: BLE001 - even then, one table
        why = traceback.format_exc()
        print(why, file=sys.stderr)
        print("\n" + "=" * 30 + " GPU smoke table " + "=" * 30)
        print(judge.judge_all({"fatal": "the suite could not start: " + why.strip().splitlines()[-1]})["table"])
        return 2
    return suite.run()


if __name__ == "__main__":
    sys.exit(main())
