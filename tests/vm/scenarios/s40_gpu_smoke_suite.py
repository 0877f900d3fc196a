"""Scenario 40: the GPU smoke suite (tests/gpu/smoke.py) on a pure cgroup v2 host with runc 1.1.5,
the fake driver standing in for NVIDIA's (no nvidia-smi, NVML or CUDA: inside, open() decides).

What the GPU machine runs, end to end, before its one run there: sync and the link check on real
nodes, the daemon's relink and new-node rounds, runc containers with the cgroupfs driver whose
device programs the suite replaces (systemd-style) and whose NVIDIA hook stand-in prepends its
blocks to runc's program, then deletes. Checked here: every step ran (no ERROR row), the kernel
agrees with what each scenario was built to be (opens from inside), and nothing is left behind.
The verdict columns are whatever this tree's nvsymlinkd says (its disagreements are the suite's
findings, not this scenario's failures).
"""
# vm: nvsymlinkd=off timeout=1200 matrix=full
import json
import os
import subprocess
import sys

from tests.vm.guest.vmguest import RESULTS, SRC, Scenario, load_fake_driver, mknod

with Scenario() as sc:
    majors = load_fake_driver(uvm=True)
    mknod("/dev/nvidia0", 195, 0)
    mknod("/dev/nvidiactl", 195, 255)
    mknod("/dev/nvidia-uvm", majors["nvidia-uvm"], 0)
    mknod("/dev/nvidia-uvm-tools", majors["nvidia-uvm"], 1)
    out = os.path.join(RESULTS, "gpusmoke")
    env = dict(os.environ, PYTHONPATH=SRC, PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([sys.executable, f"{SRC}/tests/gpu/smoke.py", "--out", out, "--budget", "1000",
                           "--runc", "/usr/sbin/runc"], capture_output=True, text=True, timeout=1100, env=env)
    with open(os.path.join(RESULTS, "gpusmoke.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    table = proc.stdout.rpartition("GPU smoke table")[2]
    print(table)
    sc.check("the suite printed its table and exited 0, 1 or 2", "rows:" in table and proc.returncode in (0, 1, 2),
             f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}")
    doc = json.load(open(os.path.join(out, "gpu-smoke.json")))
    sc.fact("table", table.strip().splitlines())
    rows = {r["cells"][0]: r for r in doc.get("judgement") or []}
    for name in ("sync + links", "daemon: relink", "daemon: new node"):
        sc.check(f"{name}: agrees", rows.get(name, {}).get("outcome") == "agree", json.dumps(rows.get(name)))
    got = {c["name"]: c for c in doc["containers"]}
    for name, c in got.items():
        sc.check(f"{name}: built and observed", not c.get("error"), str(c.get("error")))

    def opens(obs):
        return set((obs or {}).get("opens", {}).values())

    sc.check("a-healthy opens every node", opens(got["a-healthy"]["inside"]) == {"ok"}, str(got["a-healthy"]["inside"]))
    sc.check("c-never-allowed: every node EPERM", opens(got["c-never-allowed"]["inside"]) == {"EPERM"})
    for name in ("d-replaced", "e-hook-lost"):
        c = got[name]
        sc.check(f"{name}: granted first (runc's / the hook's program)", opens(c.get("before")) == {"ok"}, str(c.get("before")))
        sc.check(f"{name}: taken by the replaced program", opens(c.get("inside")) == {"EPERM"}, str(c.get("inside")))
        sc.check(f"{name}: the v2 path", any(s.startswith("v2: ") for s in c.get("steps") or []), str(c.get("steps")))
    left = subprocess.run(["/usr/sbin/runc", "list", "-q"], capture_output=True, text=True).stdout.split()
    sc.check("no container left", not [c for c in left if c.startswith("gpusmoke-")], str(left))
    sc.check("no cgroup left", not [d for d in os.listdir("/sys/fs/cgroup") if d.startswith("gpusmoke-")])
