"""Defects found by trying to break nvsymlinkd, round two (issue 26), each as an operator or an
attacker meets it: through the CLI or the daemon as a subprocess.

Each test here failed on the code before its fix.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.daemonproc import DaemonProcess
from tests.fakehost import standard_host
from tests.test_daemon import STANDARD_LINKS, links

NVS = [sys.executable, "-m", "nvsymlinkd"]


def cli(*argv, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*NVS, *map(os.fsdecode, argv)], capture_output=True, text=True, timeout=timeout,
                          errors="surrogateescape", **kw)


def no_traceback(proc: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "Error:" not in proc.stderr.replace("error:", ""), proc.stderr


@pytest.fixture
def host(tmp_path, need_root):
    h = standard_host(tmp_path / "root")
    h.node("/dev/null", 1, 3)
    return h


# -- 7. one rule for a /dev/char name ------------------------------------------------------------------------

ARABIC = "\u0661\u0669\u0665:7"  # "١٩٥:7": int() reads 195, but it is no /dev/char name of ours


def test_daemon_and_sync_agree_on_non_ascii_digit_names(host, tmp_path):
    cfg = tmp_path / "nvsymlinkd.toml"
    cfg.write_text("resync_interval = 0\n")
    d = DaemonProcess(host.root, config=cfg, env={"NVSYMLINKD_DEBUG": "1"})
    try:
        d.wait_until(lambda: links(host) == STANDARD_LINKS, "the first full sync")
        d.wait_for_line(r"links directory watched")  # from now on, events make incremental passes
        os.symlink("../nvidia7", host.path(f"/dev/char/{ARABIC}"))  # a stale 195:7 link, were it ours
        os.unlink(host.path("/dev/char/195:1"))  # a change the watch acts on, after the odd name's event
        d.wait_until(lambda: (links(host) or {}).get("195:1") == "../nvidia1", "195:1 to come back")
        time.sleep(0.5)
        assert os.path.islink(host.path(f"/dev/char/{ARABIC}")), d.output()
    finally:
        d.stop()
    # and the full sync leaves it too
    proc = cli("--root", host.root, "--config", cfg, "sync")
    assert proc.returncode == 0, proc.stderr
    assert os.path.islink(host.path(f"/dev/char/{ARABIC}"))


# -- 10. smaller ----------------------------------------------------------------------------------------------

def test_record_dataclass_refuses_a_mutable_default_like_dataclasses():
    import dataclasses

    from nvsymlinkd import record

    for default in ([], {}, set()):
        with pytest.raises(ValueError, match="mutable default"):
            dataclasses.dataclass(frozen=True)(type("A", (), {"__annotations__": {"x": "list"}, "x": default}))
        with pytest.raises(ValueError, match="mutable default"):
            record.dataclass(frozen=True)(type("B", (), {"__annotations__": {"x": "list"}, "x": default}))
    record.dataclass(frozen=True)(type("C", (), {"__annotations__": {"x": "tuple"}, "x": ()}))


@pytest.mark.parametrize("where", ["flag", "file"])
def test_negative_zero_resync_interval_renders_as_off(tmp_path, where):
    cfg = tmp_path / "c.toml"
    cfg.write_text("resync_interval = -0.0\n" if where == "file" else "")
    flags = ["--resync-interval", "-0.0"] if where == "flag" else []
    proc = cli("--config", cfg, "render", *flags)
    assert proc.returncode == 0, proc.stderr
    assert "-0" not in proc.stdout.replace("--", "  "), proc.stdout
    assert "--resync-interval 0" in proc.stdout


def test_a_directory_left_at_a_temporary_name_is_removed_not_reported_forever(host):
    host.params()
    odd = host.path("/dev/char/.nvsymlinkd-tmp-4194000-195:0")
    odd.parent.mkdir(parents=True, exist_ok=True)
    odd.mkdir()
    first = cli("--root", host.root, "--config", os.devnull, "sync")
    assert first.returncode == 0, first.stderr
    assert not odd.exists()
    again = cli("--root", host.root, "--config", os.devnull, "sync", "--dry-run")
    assert ".nvsymlinkd-tmp-" not in again.stdout + again.stderr
    # a full directory there is nobody's temporary of ours: not emptied, and not "removed" on every run
    odd.mkdir()
    (odd / "keep").write_text("")
    for _ in range(2):
        proc = cli("--root", host.root, "--config", os.devnull, "sync")
        assert ".nvsymlinkd-tmp-" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert (odd / "keep").exists()


# -- 3. the config file, read as runtime files are -----------------------------------------------------------

@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "default-fifo", "too-big"])
def test_config_that_is_no_regular_file_is_refused_at_once(tmp_path, kind):
    root = tmp_path / "root"
    (root / "etc/nvsymlinkd").mkdir(parents=True)
    argv = ["--root", root]
    if kind == "dev-zero":
        argv += ["--config", "/dev/zero"]
    elif kind == "fifo":
        os.mkfifo(tmp_path / "fifo")
        argv += ["--config", tmp_path / "fifo"]
    elif kind == "default-fifo":
        os.mkfifo(root / "etc/nvsymlinkd/nvsymlinkd.toml")
    else:
        big = tmp_path / "big.toml"
        big.write_text("# " + "x" * (2 << 20) + "\n")
        argv += ["--config", big]
    start = time.monotonic()
    proc = cli(*argv, "sync", "--dry-run", timeout=20)
    assert time.monotonic() - start < 10
    assert proc.returncode == 2, proc.stderr
    no_traceback(proc)
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert ("not a regular file" if kind != "too-big" else "larger than") in proc.stderr
    # /dev/null stays "no config" (packaging renders with it)
    assert cli("--config", "/dev/null", "render").returncode == 0


# -- 2, 5, 6. what a container can write, in the operator's terminal; the exit status through a pipe ----------

EVIL = "docker-x\x1b[2J\x1b[31mPWNED\nforged line"  # item 6; with "\ud800" appended: item 2


@pytest.fixture(params=["escape", "escape+surrogate"])
def evil_host(fakehost, v1_parent, request):
    """A lost GPU container (plain runc, systemd driver names) whose state.json names an evil scope."""
    import json

    from tests.test_hostile_input import LostHost

    h = LostHost(fakehost, v1_parent, "runc")
    doc = h.doc(h.state)
    doc["config"]["cgroups"].update(name=EVIL + ("\ud800" if "surrogate" in request.param else ""), scope_prefix="docker", Systemd=True)
    h.put(h.state, json.dumps(doc))
    return h


def _assert_escaped(out: str) -> None:
    assert "\x1b" not in out and "\ud800" not in out, repr(out)
    assert not any(line.startswith("forged line") for line in out.splitlines()), out


@pytest.mark.parametrize("command", [["check", "--no-host", "--no-bus"], ["repair", "--dry-run"]])
def test_untrusted_names_are_escaped_in_human_output(evil_host, command):
    proc = cli("--root", evil_host.root, *command)
    no_traceback(proc)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    _assert_escaped(proc.stdout)
    assert "\\x1b[2J" in proc.stdout, proc.stdout  # still there to be read, escaped


def test_check_into_a_closed_pipe_keeps_the_exit_status_of_what_was_found(evil_host):
    # `check | head -1` under pipefail (`| true`: a reader gone before the first write, every time): the host is not as desired, whatever the reader did
    cmd = " ".join(["set -o pipefail;", *NVS, "--root", str(evil_host.root), "check", "--no-bus", "|", "true"])  # gone before the first write
    proc = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


# -- 1. state written outside --root -------------------------------------------------------------------------

@pytest.fixture
def lost_host(fakehost, v1_parent):
    from tests.test_hostile_input import LostHost

    return LostHost(fakehost, v1_parent, "runc")


def _all_files(top) -> list:
    """Every name under top, with a file's content and a link's text: what a write outside would change."""
    out = []
    for d, dirs, files in os.walk(top):
        for n in dirs + files:
            p = os.path.join(d, n)
            if os.path.islink(p):
                out.append((p, "->", os.readlink(p)))
            elif os.path.isfile(p):
                out.append((p, open(p, "rb").read()))
            else:
                out.append((p,))
    return sorted(out)


@pytest.mark.parametrize("link", ["absolute", "relative", "run-absolute", "inner-links"])
def test_state_is_never_written_outside_the_root(lost_host, tmp_path, link):
    """ROOT/run/nvsymlinkd (or ROOT/run, or what is in the state dir) and the metrics directory are links
    that lead out of the root when followed by the host's rules: the repair history, the lock, the
    baselines and the textfile stay inside."""
    root = lost_host.host.root
    outside = tmp_path / "outside"
    for sub in ("state", "metrics", "run/nvsymlinkd"):
        (outside / sub).mkdir(parents=True)
    (outside / "metrics" / "keep").write_text("")
    up = os.path.relpath(outside, root / "run")
    if link == "run-absolute":  # a link higher up: ROOT/run -> /outside/run (lost_host's files moved there)
        import shutil

        for name in os.listdir(root / "run"):
            shutil.move(str(root / "run" / name), str(outside / "run" / name))
        os.rmdir(root / "run")
        os.symlink(str(outside / "run"), root / "run")
        shutil.copytree(outside / "run", root / str(outside / "run").lstrip("/"), symlinks=True)
        shutil.rmtree(root / str(outside / "run/nvsymlinkd").lstrip("/"))
    elif link == "inner-links":  # the state dir is real; what is in it points out
        state = root / "run/nvsymlinkd"
        state.mkdir()
        for name in ("baselines", "frozen"):
            os.symlink(str(outside / "state"), state / name)
        for name in ("repairs.json", "repair.lock"):
            (outside / "state" / name).write_text("{}\n")
            os.symlink(str(outside / "state" / name), state / name)
    else:
        os.symlink(str(outside / "state") if link == "absolute" else f"{up}/state", root / "run/nvsymlinkd")
    os.symlink(str(outside / "metrics") if link != "relative" else f"../{up}/metrics", root / "srv/metrics")
    before = _all_files(outside)
    proc = cli("--root", root, "repair")
    no_traceback(proc)
    cfg = tmp_path / "nvsymlinkd.toml"
    cfg.write_text('resync_interval = 1\nmetrics_textfile = "/srv/metrics/nvsymlinkd.prom"\n')
    d = DaemonProcess(root, config=cfg, env={"NVSYMLINKD_DEBUG": "1"})
    try:
        d.wait_for_line(r"verified \d+ GPU container")
        time.sleep(1.5)  # a resync, a metrics write
    finally:
        d.stop()
    assert _all_files(outside) == before, proc.stdout + proc.stderr + d.output()
    # the freeze path's lock and record (a systemd-driver repair): refused, or written inside
    from nvsymlinkd.config import Config
    from nvsymlinkd.errors import RepairError
    from nvsymlinkd.host.root import HostRoot
    from nvsymlinkd.repair.apply import FreezeRecord, RepairLock
    from nvsymlinkd.repair.plan import RepairRequest

    hr = HostRoot(str(root))
    try:
        with RepairLock(hr, Config(), wait=0.1):
            pass
    except RepairError as exc:
        assert "cannot open the repair lock" in str(exc)  # a link to a missing directory, or the lock a link
    request = RepairRequest("lost1", "runc", "x.scope", "/lost1", None, "/lost1", "systemd", ())
    try:
        FreezeRecord(hr, Config(), request).write()
    except OSError:
        pass
    assert _all_files(outside) == before


# -- 8. locks and floods -------------------------------------------------------------------------------------

HOLD_LOCK = """
import sys, time
from nvsymlinkd.config import Config
from nvsymlinkd.host.root import HostRoot
from nvsymlinkd.repair.apply import RepairLock
with RepairLock(HostRoot(sys.argv[1]), Config(), wait=5):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def test_repair_lock_holds_when_its_file_is_unlinked(tmp_path, need_root):
    """A repair holds the host's repair lock (from its freeze to its thaw); someone removes repair.lock
    meanwhile ("a stale lock file"): a second repair still waits for the first, never overlaps it."""
    root = tmp_path / "root"
    (root / "run").mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(root), "10"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        os.unlink(root / "run/nvsymlinkd/repair.lock")
        second = subprocess.run([sys.executable, "-c", HOLD_LOCK.replace("wait=5", "wait=0.5"), str(root), "0"],
                                capture_output=True, text=True, timeout=60)
        assert second.returncode != 0 and "RepairBusy" in second.stderr, second.stdout + second.stderr
        assert "held" not in second.stdout
    finally:
        holder.kill()
        holder.wait()
    # the holder gone, the lock is free again (and its file made anew)
    again = subprocess.run([sys.executable, "-c", HOLD_LOCK, str(root), "0"], capture_output=True, text=True,
                           timeout=60)
    assert again.stdout.strip() == "held", again.stderr


def test_a_flapping_link_writer_is_corrected_every_time_and_said_once_with_a_count(host, tmp_path):
    import threading

    cfg = tmp_path / "nvsymlinkd.toml"
    cfg.write_text("resync_interval = 0\n")
    d = DaemonProcess(host.root, config=cfg, env={"NVSYMLINKD_DEBUG": "1"})
    stop = threading.Event()
    flips = [0]

    def flap():
        tmp = host.path("/dev/char/.flapper-tmp")
        while not stop.is_set():
            try:
                os.symlink("../nvidia9", tmp)
                os.rename(tmp, host.path("/dev/char/195:0"))
                flips[0] += 1
            except OSError:
                pass
            time.sleep(0.001)

    try:
        d.wait_until(lambda: links(host) == STANDARD_LINKS, "the first full sync")
        d.wait_for_line(r"links directory watched")
        t = threading.Thread(target=flap)
        t.start()
        time.sleep(3)
        stop.set()
        t.join()
        d.wait_until(lambda: links(host) == STANDARD_LINKS, "195:0 corrected after the writer stopped")
    finally:
        code = d.stop()
    out = d.output()
    said = [line for line in out.splitlines() if "replaced link /dev/char/195:0" in line]
    assert flips[0] > 100
    assert 1 <= len(said) <= 2, out[-3000:]
    counted = [line for line in out.splitlines() if "replaced /dev/char/195:0" in line]
    assert len(counted) == 1 and "another writer keeps changing it" in counted[0], out[-3000:]
    assert code == 0


# -- 9. a MIG capability node's mode is its access control --------------------------------------------------

def test_create_nodes_never_makes_a_capability_node_whose_mode_the_driver_does_not_say(fakehost):
    import stat

    fakehost.proc_devices({"nvidia": 195, "nvidia-caps": 236})
    fakehost.gpu("0000:3b:00.0", 0)
    fakehost.params(mode=0o666)
    fakehost.mig_minors({"config": 1, "monitor": 2})
    fakehost.write("/proc/driver/nvidia/capabilities/mig/config", "DeviceFileMinor: 1\nDeviceFileMode: 256\n")
    # monitor's file is missing: its node is not made 0666 from the driver-wide params
    proc = cli("--root", fakehost.root, "--config", os.devnull, "sync", "--create-nodes")
    no_traceback(proc)
    assert stat.S_IMODE(os.lstat(fakehost.path("/dev/nvidia-caps/nvidia-cap1")).st_mode) == 0o400
    assert not os.path.lexists(fakehost.path("/dev/nvidia-caps/nvidia-cap2"))
    assert "MIG capability monitor" in proc.stdout + proc.stderr and "not created" in proc.stdout + proc.stderr
    # a file without a mode line is the same
    fakehost.write("/proc/driver/nvidia/capabilities/mig/monitor", "DeviceFileMinor: 2\n")
    cli("--root", fakehost.root, "--config", os.devnull, "sync", "--create-nodes")
    assert not os.path.lexists(fakehost.path("/dev/nvidia-caps/nvidia-cap2"))


# -- 2. non-UTF-8 bytes on the command line, a corrupt repairs.json -----------------------------------------

@pytest.mark.parametrize("option", ["--driver-root", "--dev-char-path", "--state-dir", "--bindir"])
@pytest.mark.parametrize("where", ["--output", "--drop-ins"])
def test_render_refuses_a_non_utf8_command_line_path_in_one_line(tmp_path, option, where):
    proc = cli("--config", os.devnull, "render", option, b"/a\xffb", where, tmp_path / "out")
    no_traceback(proc)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "UTF-8" in proc.stderr and "\\xff" in proc.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.service*"))


@pytest.mark.parametrize("corrupt", ["huge-number", "deep"])
def test_repair_reads_a_corrupt_history_as_empty(lost_host, corrupt):
    history = lost_host.host.path("/run/nvsymlinkd/repairs.json")
    history.parent.mkdir(parents=True, exist_ok=True)
    history.write_text('{"last": {"lost1": 1' + "0" * 400 + "}}" if corrupt == "huge-number"
                       else "[" * 100_000 + "]" * 100_000)
    proc = cli("--root", lost_host.root, "repair")
    no_traceback(proc)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "repaired" in proc.stdout


# -- 4. units that say what the config says -----------------------------------------------------------------

# config text -> (directive, the path systemd must read from it), or None: refused
UNIT_CASES = {
    "not-normalized-state": ('state_dir = "/var/lib/../srv/nvs"\n', ("ReadWritePaths", "/var/srv/nvs")),
    "not-normalized-var-lib": ('state_dir = "/var/lib/./nv//state/"\n', ("StateDirectory", "nv/state")),
    "dollar-state-dir": ('state_dir = "/var/lib/nv$x"\n', ("StateDirectory", "nv$x")),
    "dollar-run": ('state_dir = "/run/nv$x"\n', ("RuntimeDirectory", "nv$x")),
    "dollar-dev-char": ('dev_char_path = "/srv/d$v"\n', ("ReadWritePaths", "-/srv/d$v")),
    "dollar-textfile": ('metrics_textfile = "/srv/m$t/n.prom"\n', ("ReadWritePaths", "-/srv/m$t")),
    "percent-space": ('state_dir = "/srv/a b%c"\n', ("ReadWritePaths", "/srv/a b%c")),
    "dev-char-root": ('dev_char_path = "/"\n', None),
    "textfile-root": ('metrics_textfile = "/"\n', None),
    "textfile-etc": ('metrics_textfile = "/etc/n.prom"\n', None),
    "textfile-top": ('metrics_textfile = "/n.prom"\n', None),
    "state-var-lib-itself": ('state_dir = "/var/lib"\n', None),
    "state-dotdot-etc": ('state_dir = "/var/lib/../../etc"\n', None),
    "dev-char-usr": ('dev_char_path = "/usr/lib/x"\n', None),
    # prove or refute: PrivateTmp=yes, ProtectHome=yes would give the daemon other directories than the CLI
    "state-tmp": ('state_dir = "/tmp/nvsymlinkd"\n', None),
    "state-var-tmp": ('state_dir = "/var/tmp/nvsymlinkd"\n', None),
    "state-home": ('state_dir = "/home/ops/nvsymlinkd"\n', None),
    "state-root-home": ('state_dir = "/root/nvsymlinkd"\n', None),
    "textfile-tmp": ('metrics_textfile = "/tmp/prom/n.prom"\n', None),
}


def _unit_words(value: str) -> list:
    """A path-list value as systemd reads it: words split, quotes removed, %% unescaped, $ kept."""
    import shlex

    return [w.replace("%%", "%") for w in shlex.split(value)]


@pytest.mark.parametrize("case", sorted(UNIT_CASES))
def test_rendered_units_say_what_the_config_says(tmp_path, case):
    from tests.conftest import need_tool

    text, expect = UNIT_CASES[case]
    cfg = tmp_path / "c.toml"
    cfg.write_text(text)
    out = tmp_path / "out"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "nvsymlinkd").write_text("#!/bin/sh\n")
    (bindir / "nvsymlinkd").chmod(0o755)
    proc = cli("--config", cfg, "render", "--bindir", bindir, "--output", out)
    no_traceback(proc)
    if expect is None:
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "c.toml" in proc.stderr, proc.stderr
        return
    assert proc.returncode == 0, proc.stderr
    tool = need_tool("systemd-analyze")
    service = (out / "nvsymlinkd.service").read_text()
    for unit in ("nvsymlinkd.service", "nvsymlinkd-sync.service"):
        v = subprocess.run([tool, "verify", "--man=no", str(out / unit)], capture_output=True, text=True,
                           timeout=120, cwd=out)
        assert v.returncode == 0 and v.stderr == "", f"{unit}:\n{v.stderr}"
    directive, path = expect
    words = [w for line in service.splitlines() if line.startswith(directive + "=")
             for w in _unit_words(line.partition("=")[2])]
    assert path in words, (directive, words)


# -- prove or refute: the verify cache on a filesystem with one-second timestamps --------------------------

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


# -- prove or refute: a data root that is an absolute symlink on the host, seen under --root -----------------

def test_an_absolute_symlinked_data_root_is_followed_inside_the_root(fakehost, tmp_path):
    """/var/lib/docker -> /data/docker and /var/lib/containers -> /data/containers on the host, the pod
    sees it at --root: names and the Podman bundle come from ROOT/data/..., never the pod's own /data."""
    import json
    import shutil

    from tests.fixtures.runtimes.layouts import Layouts, oci_spec, spec_rule

    fakehost.proc_devices({"nvidia-frontend": 195})
    fakehost.node("/dev/nvidia0", 195, 0)
    spec = oci_spec(rules=[spec_rule(195, 0)], env=["NVIDIA_VISIBLE_DEVICES=0"])
    lay = Layouts(fakehost)
    docker_id, podman_id = "d" * 64, "e" * 64
    lay.docker(docker_id, spec)
    lay.write_json(f"/var/lib/docker/containers/{docker_id}/config.v2.json", {"Name": "/web"})
    lay.podman_graphroot(podman_id, spec)
    for name in ("docker", "containers"):
        fakehost.path("/data").mkdir(exist_ok=True)
        shutil.move(str(fakehost.path(f"/var/lib/{name}")), str(fakehost.path(f"/data/{name}")))
        os.symlink(f"/data/{name}", fakehost.path(f"/var/lib/{name}"))  # absolute: the host's /data
    proc = cli("--root", fakehost.root, "check", "--json", "--no-host", "--no-bus")
    no_traceback(proc)
    doc = json.loads(proc.stdout)
    by_id = {c["id"]: c for c in doc["containers"]}
    assert by_id[docker_id].get("container_name") == "web", by_id[docker_id]
    assert podman_id in by_id, doc  # its spec (a GPU sign) found in ROOT/data/containers


def test_sync_dry_run_into_a_closed_pipe_keeps_its_exit_status(host):
    cmd = " ".join(["set -o pipefail;", *NVS, "--root", str(host.root), "--config", os.devnull, "sync", "--dry-run",
                    "|", "true"])
    proc = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr  # links would be created: not as desired
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


def test_daemon_log_lines_on_stderr_escape_untrusted_names(evil_host, tmp_path):
    """Without journald the daemon writes one line per entry to stderr (journald's stream parser, or a
    terminal): a newline in a scope name would forge an entry, an escape sequence reach the terminal."""
    cfg = tmp_path / "nvsymlinkd.toml"
    cfg.write_text('resync_interval = 0\nrepair = "report"\n')
    d = DaemonProcess(evil_host.root, config=cfg, env={"NVSYMLINKD_DEBUG": "1"})
    try:
        d.wait_for_line(r"verified \d+ GPU container")
        time.sleep(0.5)
    finally:
        d.stop()
    out = d.output()
    assert "PWNED" in out, out  # the name is there, escaped
    _assert_escaped(out)
