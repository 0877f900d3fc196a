"""Guest side: run the scenarios the host asked for, write results to the share, then return
(vm-scenario.service powers the guest off either way).

Runs from the read-only source share (/mnt/src) as a oneshot unit after multi-user.target.
Reads /mnt/run/scenarios.txt (one name a line), runs tests/vm/scenarios/<name>.py with the
project on PYTHONPATH (the scenarios import `tests.vm.guest.vmguest`, `nvsymlinkd`, ...), and
writes /mnt/run/results/:
<name>.json (the verdict, written by the scenario itself), <name>.log (its output),
journal.txt (the whole boot's journal), runner.json (boot time, exit codes: written last, by a
rename, so the host may stop qemu as soon as it appears).

Base snapshot (vmhost.py, docs/vm.md "How a run starts"): with /mnt/run/snapshot-base present the
runner installs nvsymlinkd as for a scenario, writes results/base-ready.json, unmounts both 9p
shares (a mounted share blocks QEMU's migration) and polls: mount the run tag, look for
scenarios.txt, unmount if absent. The host saves the machine meanwhile; each restore of it wakes
in that loop, finds its own run dir and goes on as a booted guest would.
"""
import json
import os
import subprocess
import sys
import time

SRC = "/mnt/src"
RUN = "/mnt/run"
RESULTS = os.path.join(RUN, "results")
SNAPSHOT_REQUEST = os.path.join(RUN, "snapshot-base")
# the mount units' options (tests/vm/image/files/etc/systemd/system/mnt-*.mount)
MOUNT_OPTIONS = "trans=virtio,version=9p2000.L,msize=262144"


def boot_seconds():
    with open("/proc/uptime") as f:
        return float(f.read().split()[0])


def nvsymlinkd_mode():
    """nvsymlinkd.vm=off|deb|source on the kernel command line (the scenario's '# vm:' line)."""
    with open("/proc/cmdline") as f:
        for word in f.read().split():
            if word.startswith("nvsymlinkd.vm="):
                return word.split("=", 1)[1]
    return "off"


def _write_json(path, data):
    # The share is synchronous, but a file is visible from its creation: rename a complete one in.
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
    os.rename(path + ".tmp", path)


def _mount(tag, where, mode):
    return subprocess.run(["mount", "-t", "9p", "-o", f"{MOUNT_OPTIONS},{mode}", tag, where],
                          capture_output=True).returncode == 0


def wait_to_be_restored(runner):
    """Leave both shares (nothing may stay open or be the cwd there), then poll the run tag until
    a run dir with scenarios.txt is behind it: the host saved the machine while the shares were
    unmounted, and each restore of it sees its own run dir here."""
    _write_json(os.path.join(RESULTS, "base-ready.json"), runner)
    for where in ("/mnt/src", RUN):
        proc = subprocess.run(["umount", where], capture_output=True, text=True)
        if proc.returncode != 0:
            # The host's migrate stays blocked and it fails the base build with the console.
            print(f"vm-runner: umount {where} failed: {proc.stderr.strip()}", flush=True)
    print("vm-runner: base ready, shares unmounted; waiting to be restored", flush=True)
    while True:
        time.sleep(0.5)
        if not _mount("run", RUN, "rw"):
            continue
        if os.path.exists(os.path.join(RUN, "scenarios.txt")):
            break
        subprocess.run(["umount", RUN], capture_output=True)
    if not _mount("src", "/mnt/src", "ro"):
        print("vm-runner: mounting /mnt/src after the restore failed", flush=True)
    runner["start"] = "restored"
    runner["restored_uptime_s"] = round(boot_seconds(), 1)
    print("vm-runner: restored", flush=True)


def main():
    # Kernel start to this unit starting (systemd, udev, D-Bus, the 9p mounts all up).
    runner = {"boot_s": round(boot_seconds(), 1), "start": "booted", "scenarios": {}}
    # The host watches for this: no marker within its boot budget means a hung boot.
    with open(os.path.join(RESULTS, "started"), "w") as f:
        f.write(str(runner["boot_s"]))
    mode = nvsymlinkd_mode()
    runner["nvsymlinkd"] = mode
    install_log = None
    if mode in ("deb", "source"):
        # Before any scenario code: the daemon is up before the driver loads or a container
        # starts, as on a host where the package is installed and enabled.
        from tests.vm.guest import vmguest

        start = time.monotonic()
        try:
            if mode == "deb":
                runner["dpkg_install_s"] = round(vmguest.install_nvsymlinkd_deb(os.path.join(RUN, "nvsymlinkd.deb")), 2)
            else:
                vmguest.install_nvsymlinkd_from_source()
            runner["nvsymlinkd_start_s"] = round(time.monotonic() - start, 2)
        except Exception as e:  # noqa: BLE001 - recorded, and every scenario then fails on it
            runner["nvsymlinkd_error"] = str(e)
            vmguest._record_install(mode, time.monotonic() - start, "", error=str(e))
            print(f"vm-runner: installing nvsymlinkd ({mode}) failed: {e}", flush=True)
        try:
            with open(vmguest.INSTALL_RECORD) as f:
                install_log = json.load(f).get("log", "")
        except (OSError, ValueError):
            pass
    if os.path.exists(SNAPSHOT_REQUEST):
        wait_to_be_restored(runner)
        with open(os.path.join(RESULTS, "started"), "w") as f:
            f.write("restored")
    if install_log is not None:
        with open(os.path.join(RESULTS, "nvsymlinkd-install.log"), "w") as out:
            out.write(install_log)
    with open(os.path.join(RUN, "scenarios.txt")) as f:
        names = [line.strip() for line in f if line.strip()]
    try:
        with open(os.path.join(RUN, "timeout")) as f:
            timeout = float(f.read())
    except (OSError, ValueError):
        timeout = 300.0
    env = dict(os.environ, PYTHONPATH=SRC, PYTHONDONTWRITEBYTECODE="1",
               VM_RESULTS=RESULTS, VM_MODULES=os.path.join(RUN, "modules"))
    for name in names:
        # NAME@v1: the same script, booted on the other cgroup hierarchy (vmhost.py)
        script = os.path.join(SRC, "tests", "vm", "scenarios", f"{name.split('@', 1)[0]}.py")
        print(f"vm-runner: scenario {name} starts", flush=True)
        start = time.monotonic()
        with open(os.path.join(RESULTS, f"{name}.log"), "w") as out:
            try:
                proc = subprocess.run([sys.executable, script], stdout=out, stderr=subprocess.STDOUT,
                                      env=dict(env, VM_SCENARIO=name), timeout=timeout, cwd="/")
                code = proc.returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
        elapsed = round(time.monotonic() - start, 2)
        runner["scenarios"][name] = {"exit": code, "elapsed_s": elapsed}
        verdict = os.path.join(RESULTS, f"{name}.json")
        if not os.path.exists(verdict):
            # The scenario died before writing its verdict: record that as a failure.
            with open(verdict, "w") as f:
                json.dump({"name": name, "ok": False, "checks": [], "timings": {},
                           "error": f"scenario exited {code} without a verdict; see {name}.log"}, f)
        print(f"vm-runner: scenario {name} exit {code} in {elapsed} s", flush=True)
    # Containers' busybox sleep ignores SIGTERM as PID 1: delete them now, or poweroff waits 90 s.
    ids = subprocess.run(["runc", "list", "-q"], capture_output=True, text=True).stdout.split()
    for cid in ids:
        subprocess.run(["runc", "delete", "--force", cid], capture_output=True, timeout=60)
    with open(os.path.join(RESULTS, "journal.txt"), "w") as out:
        subprocess.run(["journalctl", "-b", "--no-pager", "-o", "short-monotonic"], stdout=out,
                       stderr=subprocess.STDOUT, timeout=60)
    _write_json(os.path.join(RESULTS, "runner.json"), runner)
    os.sync()


if __name__ == "__main__":
    # run by vm-scenario.service as /mnt/src/tests/vm/guest/runner.py: the checkout's root on the
    # path, for `tests.vm.guest.vmguest` (and the `nvsymlinkd` it installs from)
    sys.path[:0] = [SRC]
    main()
