# vm: nvsymlinkd=deb timeout=900 matrix=full
"""Scenario 27: a hook config that refuses unprivileged GPU requests, where the GPU Operator and a driver
container put it: nvsymlinkd gives an unprivileged NVIDIA_VISIBLE_DEVICES=all container nothing the hook
refused, through reloads, the daemon's passes, a restart and `nvsymlinkd repair`; a privileged one keeps
its GPU (issue 34).

Plain runc (systemd cgroup), gpupoll as PID 1 of each container (open /dev/nvidia0 every 10 ms); the node
is in linux.devices of every container (made by runc, granted by nothing in the spec), so the kernel
judges: EPERM where the hook refused, OK where it granted. The legacy NVIDIA prestart hook
(guest/nvidia_hook.py) reads its config.toml where the hook of its toolkit release reads it and refuses
NVIDIA_VISIBLE_DEVICES from a container without CAP_SYS_ADMIN when
`accept-nvidia-visible-devices-envvar-when-unprivileged = false` there.

  A. GPU Operator-shaped host: the hook entry is /usr/local/nvidia/toolkit/nvidia-container-runtime-hook,
     the toolkit installer's 1.18 wrapper (NVIDIA_CTK_CONFIG_FILE_PATH=/usr/local/nvidia/toolkit/.config/
     nvidia-container-runtime/config.toml, cmd/nvidia-ctk-installer/toolkit/installer/executables.go) around
     a .real carrying a 1.18.0 build's version flag; that config refuses, /etc's accepts.
  B. driver-container host: the package's hook at /usr/bin (1.17.8, no -config), the config refusing at
     /run/nvidia/driver/etc/nvidia-container-runtime/config.toml (read first by 1.13-1.17), /etc's accepts;
     its bundles under /tmp (the unit's PrivateTmp= hides them: the daemon reads them as the host sees them).
  In each: the unprivileged container opens nothing at start (the hook refused), the privileged one opens
  its GPU and the daemon prevents its loss (repair-prevented, no repair-failed); then reloads, periodic
  passes (resync_interval 5 s), a restart of nvsymlinkd (its first pass) and `nvsymlinkd repair` (all, then
  the unprivileged one by name with --force): the unprivileged one never opens /dev/nvidia0 (gpupoll: no
  successful open at all), its scope's DeviceAllow never holds c 195:0, nothing journals a repair of it;
  the privileged one has 0 denied opens (v1: only systemd's own re-apply windows). `check --json` and the
  daemon (its last container-* journal entry) give the same verdict for all four containers.
  C. control, what nvsymlinkd gives back when the file it reads is not the one the hook read: nvsymlinkd
     stopped, /etc refusing (no driver-root file), an unprivileged container under the /usr/bin hook:
     EPERM; /etc rewritten to accept (the hook's file and nvsymlinkd's now differ, as /etc and the
     Operator's file differ in A); `check` expects c 195:0 from the hook and says lost, and `nvsymlinkd
     repair` puts c 195:0 into the scope's DeviceAllow (what A and B check never happens); v1: the container
     opens the GPU (EPERM -> OK, devices.allow); v2: runc's own program, which the refusing hook never
     replaced, still denies it (recorded). That is what reading /etc in A (or B) would have done.
"""
import glob
import json
import os
import subprocess
import tarfile
import time

from nvsymlinkd.messageids import MESSAGE_IDS
from tests.vm.guest.nvidia_hook import DRIVER_CONFIG, ETC_CONFIG
from tests.vm.guest.nvidia_hook import LOG as HOOK_LOG
from tests.vm.guest.stacks import (
    GUEST_DIR,
    HOOK,
    POLL_ARGV,
    POLL_LOG,
    V1_WINDOW_BOUND_S,
    PollLog,
    build_rootfs_tar,
    check_json,
    hierarchy,
    install_nvidia_toolkit,
    journal_since,
    publish_gpu_list,
)
from tests.vm.guest.vmguest import (
    WORK,
    Container,
    DeviceNode,
    Scenario,
    daemon_reload,
    device_spec,
    expect_nvsymlinkd,
    load_fake_driver,
    mknod,
    nvsymlinkd,
    sh,
    unit_property,
    wait_for,
)

UNIT = "nvsymlinkd.service"
NVSYMLINKD_CONFIG = "/etc/nvsymlinkd/nvsymlinkd.toml"
DEBUG_DROP_IN = "/run/systemd/system/nvsymlinkd.service.d/60-debug.conf"
RESYNC_S = 5
RELOADS = 3
BUNDLES = "/var/lib/vmtest/bundles"  # not under /run (noexec)
TMP_BUNDLES = "/tmp/vmtest-s27"  # the driver host's: a bundle under /tmp, which the unit's PrivateTmp= hides
TOOLKIT_DIR = "/usr/local/nvidia/toolkit"
OPERATOR_HOOK = f"{TOOLKIT_DIR}/nvidia-container-runtime-hook"
OPERATOR_CONFIG = f"{TOOLKIT_DIR}/.config/nvidia-container-runtime/config.toml"
OPERATOR_VERSION = "1.18.0"
REFUSE = "accept-nvidia-visible-devices-envvar-when-unprivileged = false\n"
ACCEPT = "accept-nvidia-visible-devices-envvar-when-unprivileged = true\n"
REPAIR_IDS = [MESSAGE_IDS[k] for k in ("repair-done", "repair-prevented")]
# the daemon's verdict is its last container-* journal entry for the container (journaldiff: one per change)
VERDICT_OF_KIND = {"container-ok": "ok", "container-lost": "lost", "container-denied": "denied",
                   "container-at-risk-scope": "at-risk", "container-at-risk-not-in-spec": "at-risk",
                   "container-at-risk-uvm-missing": "at-risk", "container-unknown": "unknown"}
KIND_OF_ID = {v: k for k, v in MESSAGE_IDS.items()}


def write(path: str, text: str, mode: int = 0o644) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)


def install_operator_toolkit() -> None:
    """The GPU Operator's toolkit install: the hook as the installer's 1.18 wrapper (the shape
    hookgrant.parse_wrapper knows, tests/test_hookgrant.py) exporting the Operator's config path, around
    a .real that says its release like a 1.18.0 build's linker flag and plays that release's hook."""
    write(OPERATOR_HOOK + ".real",
          "#!/bin/sh\n"
          f"# -X github.com/NVIDIA/nvidia-container-toolkit/internal/info.version={OPERATOR_VERSION}\n"
          f"VMTEST_TOOLKIT_VERSION={OPERATOR_VERSION} exec /usr/bin/python3 {GUEST_DIR}/nvidia_hook.py \"$@\"\n",
          0o755)
    write(OPERATOR_HOOK, "#! /bin/sh\n"
          f"NVIDIA_CTK_CONFIG_FILE_PATH={OPERATOR_CONFIG} \\\n"
          f"PATH={TOOLKIT_DIR}:$PATH \\\n"
          f"\t{OPERATOR_HOOK}.real \\\n"
          "\t\t\"$@\"\n", 0o755)
    write(OPERATOR_CONFIG, REFUSE)


class Ctr(Container):
    """runc-<name>.scope, gpupoll as PID 1, NVIDIA_VISIBLE_DEVICES=all, the legacy hook at `hook` as its
    prestart hook; /dev/nvidia0 made by runc (linux.devices) and granted by nothing in the spec;
    privileged: CAP_SYS_ADMIN in the bounding set (the toolkit's IsPrivileged)."""

    def __init__(self, name: str, hook: str, privileged: bool, gpu: DeviceNode, bundles: str = BUNDLES):
        bundle = os.path.join(bundles, name)
        rootfs = os.path.join(bundle, "rootfs")
        os.makedirs(rootfs, exist_ok=True)
        with tarfile.open(build_rootfs_tar()) as tar:
            tar.extractall(rootfs)
        sh("runc", "spec", cwd=bundle)
        with open(os.path.join(bundle, "config.json")) as f:
            spec = json.load(f)
        spec["root"] = {"path": rootfs, "readonly": False}
        process = spec["process"]
        process["terminal"] = False
        process["args"] = list(POLL_ARGV)
        process["env"].append("NVIDIA_VISIBLE_DEVICES=all")
        if privileged:
            for kind in ("bounding", "effective", "permitted"):
                process["capabilities"][kind] = sorted(set(process["capabilities"].get(kind, [])) | {"CAP_SYS_ADMIN"})
        linux = spec["linux"]
        linux["cgroupsPath"] = f"system.slice:runc:{name}"
        linux["devices"] = [device_spec(gpu)]
        linux.setdefault("resources", {}).setdefault("devices", [{"allow": False, "access": "rwm"}])
        spec["hooks"] = {"prestart": [{"path": hook, "args": [os.path.basename(hook), "prestart"]}]}
        with open(os.path.join(bundle, "config.json"), "w") as f:
            json.dump(spec, f, indent=1)
        runc_log = os.path.join(WORK, f"{name}.runc.log")
        output = os.path.join(WORK, f"{name}.out")
        with open(output, "w") as out:
            proc = subprocess.run(["runc", "--systemd-cgroup", "--log", runc_log, "--log-format", "text", "run",
                                   "--detach", "--bundle", bundle, name], stdin=subprocess.DEVNULL, stdout=out,
                                  stderr=out, timeout=120)
        super().__init__(name, bundle, runc_log, output)
        if proc.returncode != 0:
            raise RuntimeError(f"runc run {name} exited {proc.returncode}: {self.runc_log()[-2000:]}")
        self.privileged = privileged
        self.log_path = rootfs + POLL_LOG
        wait_for(lambda: self.poll().last_alive, timeout=30, interval=0.1)

    def poll(self) -> PollLog:
        try:
            with open(self.log_path) as f:
                return PollLog.parse(f.read())
        except OSError:
            return PollLog()


def hook_line(name: str) -> str:
    try:
        with open(HOOK_LOG) as f:
            return "; ".join(line.strip() for line in f if line.startswith(f"{name}: ") and "hook started" not in line)
    except OSError:
        return ""


def report_of(name: str, report: dict = None) -> dict:
    report = report if report is not None else check_json()
    return next((c for c in report.get("containers", []) if c.get("id") == name), {})


def recorded_config(name: str) -> dict:
    """The daemon's record of the hook's inputs at the container's first sight (containers.hookrecord)."""
    try:
        with open(f"/run/nvsymlinkd/hookinputs/{name}.json") as f:
            config = json.load(f)["inputs"]["config"]
        return {k: config.get(k) for k in ("path", "accept_envvar_unprivileged", "readable")}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return {"error": repr(exc)[:200]}


def never_opened(log: PollLog) -> bool:
    """gpupoll never opened the node: a denial from its first round on and no closed window."""
    return (not log.windows and log.open_window is not None and log.started is not None
            and log.open_window - log.started < 1.0 and bool(log.denied)
            and all(e == "EPERM" for _, e in log.denied))


def scope_has_gpu(ctr: Ctr, majors) -> str:
    """An NVIDIA node (major 195, nvidia-uvm's) in the scope's DeviceAllow or in a drop-in of ours, ''
    when in neither."""
    marks = [f"/dev/char/{m}:" for m in majors] + [f"char-{n}" for n in ("nvidia-frontend", "nvidia-uvm")]
    allow = unit_property(ctr.scope, "DeviceAllow")
    dropins = glob.glob(f"/run/systemd/system/{ctr.scope}.d/*nvsymlinkd*")
    text = "".join(open(p).read() for p in dropins)
    return (("DeviceAllow " + allow if any(m in allow for m in marks) else "")
            + (" drop-in " + text if any(m in text for m in marks) else ""))


def wait_seen(sc, unpriv: Ctr, priv: Ctr, label: str) -> None:
    """The daemon has seen both: the privileged one prevented (its scope holds the hook's grant)."""
    def both():
        report = check_json()
        p, u = report_of(priv.name, report), report_of(unpriv.name, report)
        return (p, u) if p.get("verdict") == "ok" and u.get("verdict") else None
    got, waited = wait_for(both, timeout=60, interval=1.0)
    p, u = got or (report_of(priv.name), report_of(unpriv.name))
    sc.timing(f"{label}_seen_s", waited)
    for c in (priv, unpriv):
        sc.fact(f"{label}_daemon_journal_{c.name}", [f"{k}: {m[:300]}" for k, m in daemon_entries(c.name)][:20])
    if not got:
        sc.fact(f"{label}_daemon_journal_tail", [str(e.get("MESSAGE", ""))[:300] for e in journal_since(0, UNIT)][-80:])
    hook_p, hook_u = p.get("nvidia_hook") or {}, u.get("nvidia_hook") or {}
    sc.fact(f"{label}_check_priv", {k: p.get(k) for k in ("verdict", "expected", "nvidia_hook")})
    sc.fact(f"{label}_check_unpriv", {k: u.get(k) for k in ("verdict", "expected", "nvidia_hook", "findings")})
    sc.check(f"{label}: check, the privileged one: ok, c 195:0 expected from the nvidia-hook source",
             p.get("verdict") == "ok" and "nvidia-hook" in ((p.get("expected") or {}).get("c 195:0") or {})
             .get("sources", []), f"verdict {p.get('verdict')}, hook {hook_p.get('detail')}")
    entries, _ = wait_for(lambda: [e for e in daemon_entries(priv.name) if e[0] == "repair-prevented"]
                          and daemon_entries(priv.name), timeout=15, interval=1.0)  # journaled after check's read
    entries = entries or daemon_entries(priv.name)
    sc.check(f"{label}: the daemon prevented the privileged one (repair-prevented journaled), no repair failed",
             any(k == "repair-prevented" for k, _ in entries) and not any(k == "repair-failed" for k, _ in entries),
             "; ".join(f"{k}: {m[:200]}" for k, m in entries if k.startswith("repair-")) or "no repair entry")
    sc.check(f"{label}: check, the unprivileged one: the hook's grant trusted and empty, nothing expected, "
             "not lost", hook_u.get("trusted") is True and not hook_u.get("devices")
             and "c 195:0" not in (u.get("expected") or {}) and u.get("verdict") != "lost",
             f"verdict {u.get('verdict')}, hook {hook_u}")


def daemon_entries(name: str) -> list:
    """(kind, MESSAGE) of nvsymlinkd.service's entries with CONTAINER_ID=name, oldest first."""
    return [(KIND_OF_ID.get(e.get("MESSAGE_ID"), "-"), str(e.get("MESSAGE", "")))
            for e in journal_since(0, UNIT, [f"CONTAINER_ID={name}"])]


def daemon_verdict(name: str) -> str:
    kinds = [k for k, _ in daemon_entries(name) if k in VERDICT_OF_KIND]
    return VERDICT_OF_KIND[kinds[-1]] if kinds else "none journaled"


def same_verdicts(sc, label: str, ctrs) -> None:
    """check --json and the daemon (its last journaled verdict) agree on every container."""
    report = check_json()
    got = {c.name: (report_of(c.name, report).get("verdict"), daemon_verdict(c.name)) for c in ctrs}
    sc.fact(f"{label}_verdicts_check_daemon", got)
    sc.check(f"{label}: check and the daemon give the same verdict for every container", all(
        a == b for a, b in got.values()), str(got))


def prove_host(sc, label: str, hook: str, config: str, gpu: DeviceNode, bundles: str = BUNDLES) -> tuple:
    since = int(time.time() * 1e6)
    unpriv = Ctr(f"{label}-unpriv", hook, False, gpu, bundles)
    priv = Ctr(f"{label}-priv", hook, True, gpu, bundles)
    sc.fact(f"{label}_hook_log", {c.name: hook_line(c.name) for c in (unpriv, priv)})
    sc.check(f"{label}: the hook refused the unprivileged container under {config}",
             "REFUSED" in hook_line(unpriv.name) and config in hook_line(unpriv.name), hook_line(unpriv.name))
    sc.check(f"{label}: the hook granted the privileged one under {config}",
             f"config {config}, privileged True" in hook_line(priv.name), hook_line(priv.name))
    sc.expect_open(unpriv, "/dev/nvidia0", "EPERM", "at start (the hook refused)")
    sc.expect_open(priv, "/dev/nvidia0", "OK", "at start")
    wait_seen(sc, unpriv, priv, label)
    rec_u, rec_p = recorded_config(unpriv.name), recorded_config(priv.name)
    sc.fact(f"{label}_recorded_config", {unpriv.name: rec_u, priv.name: rec_p})
    sc.check(f"{label}: the daemon recorded the hook's config as {config}, refusing",
             rec_u.get("path") == config and rec_u.get("accept_envvar_unprivileged") is False
             and rec_p.get("path") == config, f"{rec_u} / {rec_p}")
    for i in range(RELOADS):
        sc.timing(f"{label}_reload{i + 1}_s", daemon_reload())
        time.sleep(1.0)
    time.sleep(2 * RESYNC_S + 1)  # two periodic passes at least
    began = time.monotonic()
    sh("systemctl", "restart", UNIT, timeout=120)
    sc.timing(f"{label}_restart_s", time.monotonic() - began)
    time.sleep(RESYNC_S + 2)  # the new daemon's first pass and one periodic one
    everything = nvsymlinkd("repair")
    named = nvsymlinkd("repair", "--force", unpriv.name)
    sc.fact(f"{label}_repair_all", {"rc": everything.returncode, "out": (everything.stdout + everything.stderr)[-800:]})
    sc.fact(f"{label}_repair_unpriv", {"rc": named.returncode, "out": (named.stdout + named.stderr)[-800:]})
    sc.timing(f"{label}_reload_after_repair_s", daemon_reload())
    time.sleep(1.0)
    sc.expect_open(unpriv, "/dev/nvidia0", "EPERM", f"after {RELOADS + 1} reloads, passes, a restart and repair")
    sc.expect_open(priv, "/dev/nvidia0", "OK", f"after {RELOADS + 1} reloads, passes, a restart and repair")
    check_host(sc, label, unpriv, priv, since)
    same_verdicts(sc, label, (unpriv, priv))
    return unpriv, priv


def check_host(sc, label: str, unpriv: Ctr, priv: Ctr, since: int) -> None:
    log_u, log_p = unpriv.poll(), priv.poll()
    sc.fact(f"{label}_poll", {unpriv.name: log_u.summary(), priv.name: log_p.summary()})
    sc.check(f"{label}: gpupoll in the unprivileged container never opened /dev/nvidia0 (EPERM every round)",
             never_opened(log_u), log_u.summary())
    if hierarchy() == "v2":
        sc.check(f"{label}: gpupoll in the privileged container: 0 denied opens", bool(log_p.opens)
                 and not log_p.denied, log_p.summary())
    else:  # v1: systemd's own re-apply windows at each reload (stacks.judge_poll), nothing longer
        long_ = [(round(t, 3), round(d, 3)) for t, d, _ in log_p.windows if d >= V1_WINDOW_BOUND_S]
        sc.check(f"{label}: gpupoll in the privileged container: every denial window closed by itself, each "
                 f"shorter than {V1_WINDOW_BOUND_S * 1000:.0f} ms (systemd's v1 re-apply)", bool(log_p.opens)
                 and log_p.open_window is None and not long_, f"{log_p.summary()}; too long {long_}")
    held = scope_has_gpu(unpriv, MAJORS)
    sc.check(f"{label}: the unprivileged container's scope holds no NVIDIA node (DeviceAllow, our drop-in)", not held,
             held or unit_property(unpriv.scope, "DeviceAllow"))
    repairs = [e.get("MESSAGE", "") for e in journal_since(since, None) if e.get("MESSAGE_ID") in REPAIR_IDS
               and unpriv.name in str(e.get("MESSAGE", ""))]
    sc.check(f"{label}: no repair or prevention journaled for the unprivileged container", not repairs,
             "; ".join(map(str, repairs))[:600])


def control(sc, gpu: DeviceNode) -> None:
    sh("systemctl", "stop", UNIT, timeout=120)
    os.unlink(DRIVER_CONFIG)
    write(ETC_CONFIG, REFUSE)
    ctl = Ctr("ctl-unpriv", HOOK, False, gpu)
    sc.fact("control_hook_log", hook_line(ctl.name))
    sc.check(f"control: the hook refused the unprivileged container under {ETC_CONFIG}",
             "REFUSED" in hook_line(ctl.name) and ETC_CONFIG in hook_line(ctl.name), hook_line(ctl.name))
    sc.expect_open(ctl, "/dev/nvidia0", "EPERM", "at start (control)")
    write(ETC_CONFIG, ACCEPT)  # nvsymlinkd now reads a file that is not what the hook read
    got = report_of(ctl.name)
    hook = got.get("nvidia_hook") or {}
    sc.fact("control_check", {k: got.get(k) for k in ("verdict", "expected", "nvidia_hook")})
    sc.check("control: reading an accepting file, check expects c 195:0 from the hook and says lost",
             "c 195:0" in (hook.get("devices") or {}) and got.get("verdict") == "lost",
             f"verdict {got.get('verdict')}, hook {hook.get('detail')}")
    proc = nvsymlinkd("repair", ctl.name)
    sc.fact("control_repair", {"rc": proc.returncode, "out": (proc.stdout + proc.stderr)[-800:]})
    held = scope_has_gpu(ctl, MAJORS)
    sc.fact("control_scope_after_repair", held or unit_property(ctl.scope, "DeviceAllow"))
    sc.check("control: `nvsymlinkd repair` put the refused GPU into the scope's DeviceAllow (what A and B check "
             "never happens)", "/dev/char/195:0" in held, held or unit_property(ctl.scope, "DeviceAllow"))
    if hierarchy() == "v1":
        # devices.allow+systemd writes the grant into the cgroup itself: the kernel opens the refused GPU
        sc.expect_open(ctl, "/dev/nvidia0", "OK", "after nvsymlinkd repair read the accepting file (control: "
                       "the GPU the hook refused is given)")
        log = ctl.poll()
        sc.check("control: gpupoll opened /dev/nvidia0 after the repair", bool(log.windows), log.summary())
    else:
        # v2: runc's own device program (the hook refused: never replaced) stays attached beside systemd's,
        # and every program must allow (REFERENCE.md): the grant is in the policy the next runtime program
        # change leaves alone, the open still fails until then; recorded, not judged
        sc.fact("control_open_after_repair_v2", ctl.open_errno("/dev/nvidia0"))
    sc.fact("control_poll", ctl.poll().summary())
    ctl.delete()


with Scenario() as sc:
    expect_nvsymlinkd(sc)
    majors = load_fake_driver(uvm=True)
    MAJORS = (195, majors["nvidia-uvm"])
    gpu = mknod("/dev/nvidia0", 195, 0)
    nodes = [gpu, mknod("/dev/nvidiactl", 195, 255), mknod("/dev/nvidia-uvm", majors["nvidia-uvm"], 0)]
    for node in nodes:
        ok, _ = wait_for(lambda node=node: os.path.realpath(node.char_link) == node.path, timeout=15)
        sc.check(f"{node.char_link} -> {node.path}", bool(ok))
    install_nvidia_toolkit()
    install_operator_toolkit()
    write(ETC_CONFIG, ACCEPT)  # the file a reader of the wrong path finds: it accepts
    sc.check("the driver's GPU list is published under /proc/driver/nvidia/gpus", publish_gpu_list())
    os.makedirs(os.path.dirname(NVSYMLINKD_CONFIG), exist_ok=True)
    with open(NVSYMLINKD_CONFIG, "a") as f:
        f.write(f"resync_interval = {RESYNC_S}\n")
    write(DEBUG_DROP_IN, "[Service]\nEnvironment=NVSYMLINKD_DEBUG=1\n")  # each pass and its reasons journaled
    daemon_reload()  # before any container exists: it takes nothing
    sh("systemctl", "restart", UNIT, timeout=120)
    ctrs = []
    try:
        ctrs += prove_host(sc, "operator", OPERATOR_HOOK, OPERATOR_CONFIG, gpu)
        write(DRIVER_CONFIG, REFUSE)
        since = int(time.time() * 1e6)
        ctrs += prove_host(sc, "driver", HOOK, DRIVER_CONFIG, gpu, TMP_BUNDLES)
        # the operator host's containers went through the driver host's reloads, passes and repairs too
        check_host(sc, "operator (at the end)", ctrs[0], ctrs[1], since)
        sc.expect_open(ctrs[0], "/dev/nvidia0", "EPERM", "at the end")
        same_verdicts(sc, "all four (at the end)", ctrs)
        control(sc, gpu)
    finally:
        for c in ctrs:
            c.delete()
