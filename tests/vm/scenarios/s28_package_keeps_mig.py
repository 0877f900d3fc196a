# vm: nvsymlinkd=off packages=upgrade timeout=1200 hierarchies=v2 matrix=full
"""Scenario 28: the package on a node running MIG containers (issue 35, done-when 2).

The fake driver publishes an H100's MIG layout (guest/migdriver.py: GPU 0 with GPU instances 1 and 2, one
compute instance each; mig-minors, the access files, /dev/nvidia-caps nodes on the module's own nvidia-caps
major). Each container is plain runc with the NVIDIA prestart hook stand-in and
NVIDIA_VISIBLE_DEVICES=MIG-<uuid>, the device plugin's default strategy: the hook grants /dev/nvidia0 and its
instance's GI and CI access caps, outside the spec. Each polls the GPU node (gpupoll, PID 1, /dev/null as its
control) and both caps (a second gpupoll: the GI cap, the CI cap as its control) every 10 ms; the other
instance's caps are opened from the container's cgroup by a host process (the kernel's verdict without a node
in the container).

What the reconstruction trusts of a MIG request: only a MIG UUID NVML lists now (hookgrant._mig_by_uuid); a
`g:m` index never, `all` on a host with MIG instances never. This node has NVML as a real MIG node has it
(migdriver.install_fake_nvml: the real pynvml over the fake driver's libnvidia-ml.so.1, answering from the
same layout), so:
  (A) a MIG container started before the first `dpkg -i` with no daemon: `check` trusts the hook's grant
      through NVML, the postinst's prevention (`repair --before-reload`) keeps it through the package's
      reload and a later one: 0 denied opens of the GPU and both caps; the other instance's caps EPERM
      before and after; `check` ok after;
  (B) a MIG container the installed daemon saw (its healthy baseline records the hook's grant): the daemon
      stopped, /dev/char's NVIDIA links gone, `dpkg -i` of the next version (the postinst's prevention and
      daemon-reload, the restart), the operator's reload and a later one: 0 denied opens of the GPU and
      both caps; the other instance's caps EPERM before, through and after.
"""
import json
import time

from tests.vm.guest.chaosrun import cgroup_opens
from tests.vm.guest.migdriver import install_fake_nvml, load_fake_mig_driver, publish_mig_layout
from tests.vm.guest.pkgsteps import Polled, operator, the_debs, unlink_nvidia_links
from tests.vm.guest.stacks import (
    CONTROL,
    POLL_ARGV,
    POLL_LOG,
    PollLog,
    hierarchy,
    install_nvidia_toolkit,
)
from tests.vm.guest.vmguest import Scenario, daemon_reload, mknod, sh, unit_property, wait_for

MIG_A = "MIG-2a3b4c5d-aaaa-5e6f-8a9b-0c1d2e3f4a5b"  # gpu0/gi1/ci0
MIG_B = "MIG-7e8f9a0b-bbbb-5c6d-9e0f-1a2b3c4d5e6f"  # gpu0/gi2/ci0
MIG_LOG = "/tmp/mig.log"


def caps(table: dict, gi: int) -> list:
    return [f"/dev/nvidia-caps/nvidia-cap{table[f'gpu0/gi{gi}/access']}",
            f"/dev/nvidia-caps/nvidia-cap{table[f'gpu0/gi{gi}/ci0/access']}"]


class MigPolled(Polled):
    """runc + the hook, NVIDIA_VISIBLE_DEVICES=<uuid>: gpupoll on /dev/nvidia0 (PID 1) and on the two caps."""

    def __init__(self, name: str, uuid: str, mine: list, others: list):
        gi_cap, ci_cap = mine
        poll = " ".join(POLL_ARGV)
        args = ["/bin/sh", "-c", f"/bin/gpupoll {gi_cap} {MIG_LOG} 10 {ci_cap} & exec {poll}"]
        self.mine, self.others = mine, others
        super().__init__(name, hook_grants=["/dev/nvidia0"], visible=uuid, args=args)
        wait_for(lambda: self.mig_poll().last_alive, timeout=30, interval=0.1)

    def mig_poll(self) -> PollLog:
        try:
            with open(self.log_path[:-len(POLL_LOG)] + MIG_LOG) as f:
                return PollLog.parse(f.read())
        except OSError:
            return PollLog()

    def denied(self, start: float, end: float) -> dict:
        gpu, mig = self.poll(), self.mig_poll()
        return {"gpu": sum(start <= t <= end for t, _ in gpu.denied),
                "control": sum(start <= t <= end for t, _ in gpu.control_denied),
                "gi_cap": sum(start <= t <= end for t, _ in mig.denied),
                "ci_cap": sum(start <= t <= end for t, _ in mig.control_denied)}

    def alive_since(self, t: float) -> bool:
        return all((log.last_alive or 0) > t for log in (self.poll(), self.mig_poll()))

    def other_caps(self) -> dict:
        return cgroup_opens(self.state()["pid"], self.others)


def verdicts() -> dict:
    out = operator("nvsymlinkd", "check", "--json")
    try:
        return {c["id"]: c for c in json.loads(out.stdout)["containers"]}
    except (ValueError, KeyError):
        return {"error": (out.stdout + out.stderr)[-800:]}


def brief(c: dict) -> dict:
    hook = c.get("nvidia_hook") or {}
    return {"verdict": c.get("verdict"), "baseline": c.get("baseline"), "hook_trusted": hook.get("trusted"),
            "hook_detail": (hook.get("detail") or "")[:300]}


def step(sc, what: str, argv: list) -> tuple:
    """The operator's command, then its own daemon-reload and a later one; (start, end) of it all."""
    start = time.time()
    proc = operator(*argv)
    sc.fact(f"{what}_output", (proc.stdout + proc.stderr)[-3000:])
    sc.check(f"{what}: {' '.join(argv)} exits 0", proc.returncode == 0, (proc.stdout + proc.stderr)[-600:])
    daemon_reload()
    time.sleep(1.0)
    daemon_reload()  # a later reload: what the prevention wrote must hold for good
    time.sleep(1.5)  # a denial after the reload has time to show in every poller
    said = operator("journalctl", "--no-pager", "-o", "short-monotonic", "-t", "nvsymlinkd", f"--since=@{int(start)}")
    sc.fact(f"{what}_journal", said.stdout[-3000:])
    sc.timing(f"{what}_s", time.time() - start)
    return start, time.time()


with Scenario() as sc:
    wall = time.monotonic()
    old_deb, new_deb = the_debs()
    sc.fact("hierarchy", hierarchy())
    majors = load_fake_mig_driver()
    sc.fact("majors", majors)
    sc.check("the fake nvidia.ko registers an nvidia-caps major", "nvidia-caps" in majors, str(majors))
    mknod("/dev/nvidia0", 195, 0)
    mknod("/dev/nvidia-uvm", majors["nvidia-uvm"], 0)
    mknod("/dev/nvidiactl", 195, 255)
    table = publish_mig_layout({0: {1: [0], 2: [0]}}, {MIG_A: (0, 1, 0), MIG_B: (0, 2, 0)}, majors["nvidia-caps"])
    install_fake_nvml()
    nvml = sh("/usr/bin/python3", "-c", "from nvsymlinkd.containers.hookhost import read_nvml_mig as r; print(r())",
              check=False)
    sc.fact("nvml", (nvml.stdout + nvml.stderr)[-800:])
    sc.check("NVML (the real pynvml over the fake driver's library) lists both MIG devices",
             MIG_A in nvml.stdout and MIG_B in nvml.stdout, (nvml.stdout + nvml.stderr)[-600:])
    install_nvidia_toolkit()
    caps_a, caps_b = caps(table, 1), caps(table, 2)
    sc.fact("caps", {"A (gi1)": caps_a, "B (gi2)": caps_b})

    # (A) no daemon has ever run here; the first install meets the container
    unlink_nvidia_links()
    a = MigPolled("s28-mig-a", MIG_A, caps_a, caps_b)
    t = time.time()
    time.sleep(1.5)  # gpupoll says ALIVE once a second
    sc.check("A: the hook granted its GPU and both caps (0 denied opens since its start)",
             a.alive_since(t) and not any(a.denied(0, time.time()).values()), str(a.denied(0, time.time())))
    sc.check("A: the other instance's caps are EPERM from its cgroup", set(a.other_caps().values()) == {"EPERM"},
             str(a.other_caps()))
    start, end = step(sc, "install", ["dpkg", "-i", old_deb])
    seen = verdicts()
    sc.fact("install_verdicts", {k: brief(v) for k, v in seen.items()})
    hook = (seen.get(a.name) or {}).get("nvidia_hook") or {}
    sc.check("A: check trusts the hook's MIG grant through NVML", hook.get("trusted") is True, str(hook)[:600])
    denied = a.denied(start, end)
    sc.fact("install_A_denied_opens", denied)
    sc.check("A: zero denied opens of its GPU, its GI cap and its CI cap through the install and two reloads",
             a.alive_since(end - 3) and not any(denied.values()), str(denied))
    sc.check("A: the other instance's caps are EPERM after", set(a.other_caps().values()) == {"EPERM"},
             str(a.other_caps()))
    last = verdicts().get(a.name) or {}
    sc.fact("A_after_install", brief(last))
    sc.check("A: check says ok after the install", last.get("verdict") == "ok", str(brief(last)))

    # (B) a MIG container the daemon saw: its baseline holds the hook's grant
    b = MigPolled("s28-mig-b", MIG_B, caps_b, caps_a)
    sc.check("B: the daemon records its healthy baseline",
             wait_for(lambda: (verdicts().get(b.name) or {}).get("baseline") == "loaded", timeout=60, interval=1)[0],
             str(brief(verdicts().get(b.name) or {})))
    sc.fact("B_before_upgrade", brief(verdicts().get(b.name) or {}))
    operator("systemctl", "stop", "nvsymlinkd.service")  # nothing but the scripts and what is recorded may keep it
    unlink_nvidia_links()
    sc.fact("B_scope_device_allow_before_upgrade", unit_property(f"runc-{b.name}.scope", "DeviceAllow"))
    before = b.other_caps()
    start, end = step(sc, "upgrade", ["dpkg", "-i", new_deb])
    denied = b.denied(start, end)
    sc.fact("upgrade_B_denied_opens", denied)
    sc.check("B: zero denied opens of its GPU, its GI cap and its CI cap through the upgrade and two reloads",
             b.alive_since(end - 3) and not any(denied.values()), str(denied))
    after = b.other_caps()
    sc.check("B: the other instance's caps are EPERM before and after",
             set(before.values()) == {"EPERM"} and set(after.values()) == {"EPERM"}, f"before {before}, after {after}")
    sc.fact("B_scope_device_allow_after", unit_property(f"runc-{b.name}.scope", "DeviceAllow"))
    last = verdicts().get(b.name) or {}
    sc.fact("B_after_upgrade", brief(last))
    sc.check("B: check says ok after the upgrade", last.get("verdict") == "ok", str(brief(last)))
    sc.fact("control_device", CONTROL)
    for c in (a, b):
        c.remove()
    sc.timing("scenario_wall_s", time.monotonic() - wall)
