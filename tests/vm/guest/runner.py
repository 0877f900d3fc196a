"""Guest side: run the scenarios the host asked for, write results to the share, then return
(vm-scenario.service powers the guest off either way).

Runs from the read-only source share (/mnt/src) as a oneshot unit after multi-user.target.
Reads /mnt/run/scenarios.txt (one name a line), runs tests/vm/scenarios/<name>.py with
tests/vm/guest and the project on PYTHONPATH, and writes /mnt/run/results/:
<name>.json (the verdict, written by the scenario itself), <name>.log (its output),
runner.json (boot time, exit codes), journal.txt (the whole boot's journal).
"""
import json
import os
import subprocess
import sys
import time

SRC = "/mnt/src"
RUN = "/mnt/run"
RESULTS = os.path.join(RUN, "results")


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


def main():
    # Kernel start to this unit starting (systemd, udev, D-Bus, the 9p mounts all up).
    runner = {"boot_s": round(boot_seconds(), 1), "scenarios": {}}
    # The host watches for this: no marker within its boot budget means a hung boot.
    with open(os.path.join(RESULTS, "started"), "w") as f:
        f.write(str(runner["boot_s"]))
    with open(os.path.join(RUN, "scenarios.txt")) as f:
        names = [line.strip() for line in f if line.strip()]
    try:
        with open(os.path.join(RUN, "timeout")) as f:
            timeout = float(f.read())
    except (OSError, ValueError):
        timeout = 300.0
    mode = nvsymlinkd_mode()
    runner["nvsymlinkd"] = mode
    if mode in ("deb", "source"):
        # Before any scenario code: the daemon is up before the driver loads or a container
        # starts, as on a host where the package is installed and enabled.
        sys.path[:0] = [f"{SRC}/tests/vm/guest", SRC]
        import vmguest

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
            with open(vmguest.INSTALL_RECORD) as f, open(os.path.join(RESULTS, "nvsymlinkd-install.log"), "w") as out:
                out.write(json.load(f).get("log", ""))
        except (OSError, ValueError):
            pass
    env = dict(os.environ, PYTHONPATH=f"{SRC}/tests/vm/guest:{SRC}", PYTHONDONTWRITEBYTECODE="1",
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
    with open(os.path.join(RESULTS, "runner.json"), "w") as f:
        json.dump(runner, f, indent=1)
    os.sync()


if __name__ == "__main__":
    main()
