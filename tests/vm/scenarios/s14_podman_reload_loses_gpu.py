"""Scenario 14: Podman 4.3 as root, no nvsymlinkd (control). Three GPU containers: the NVIDIA OCI
hook (hooks.d, NVIDIA_VISIBLE_DEVICES=all) with crun and with runc, and CDI
(`--device nvidia.com/gpu=0`: the devices land in the spec). On `systemctl daemon-reload`:
- runc + hook loses the GPU (EPERM), as with Docker and containerd;
- crun + hook keeps it where crun runs the container in <libpod-<id>.scope>/container (v2: it
  attaches its device program, which the hook rewrites, there; systemd re-applies only the
  scope's own) and loses it where the container's device cgroup is the scope itself;
- CDI keeps it when /dev/char/195:0 exists (made here as udev would): the device is in the spec
  (on cgroup v1 with at most the short windows of systemd's deny-all-then-allow re-apply).
The last two are facts pinned here: if a crun or systemd update changes them, this fails.
"""
# vm: nvsymlinkd=off timeout=480 matrix=full hierarchies=v2,v1
import os
import time

from nvsymlinkd.access import bpfprog
from tests.vm.guest.stacks import (
    Events,
    Podman,
    device_cgroup,
    hierarchy,
    install_nvidia_toolkit,
    judge_poll,
)
from tests.vm.guest.vmguest import (
    Scenario,
    daemon_reload,
    load_fake_driver,
    make_char_link,
    mknod,
    sh,
)

with Scenario() as sc:
    majors = load_fake_driver(uvm=True)
    nodes = [mknod("/dev/nvidia0", 195, 0), mknod("/dev/nvidiactl", 195, 255),
             mknod("/dev/nvidia-uvm", majors["nvidia-uvm"], 0)]
    install_nvidia_toolkit()
    crun, runc = Podman("crun"), Podman("runc")
    sc.timing("podman_import_s", crun.start())
    try:
        ctrs = [crun.run_gpu("hook-crun"), runc.run_gpu("hook-runc")]
        for node in nodes:
            make_char_link(node)
        ctrs.append(crun.run_gpu("cdi-crun", how="cdi"))
        for ctr in ctrs:
            log = ctr.wait_polling()
            sc.check(f"{ctr.name}: gpupoll opens /dev/nvidia0 at start", bool(log.last_alive) and not log.denied,
                     log.summary())
            sc.fact(f"{ctr.name}_cgroup", ctr.cgroup().strip())
            sc.fact(f"{ctr.name}_run_paths",
                    sh("find", "/run", "-maxdepth", "7", "-name", f"{ctr.id}*", check=False).stdout.split())
        sc.check("podman containers are in libpod-<id>.scope",
                 all(c.scope() == f"libpod-{c.id}.scope" for c in ctrs), str([c.scope() for c in ctrs]))
        events = Events()
        sc.timing("daemon_reload_s", events.run("reload", daemon_reload))
        time.sleep(1.0)     # longer than any v1 re-apply window (stacks.V1_WINDOW_BOUND_S)
        log = ctrs[1].poll_log()
        sc.check("hook-runc: gpupoll saw EPERM after daemon-reload and access never came back (the loss reproduces)",
                 log.lost and any(e == "EPERM" for _, e in log.denied), log.summary())
        crun_cgroup = device_cgroup(ctrs[0])
        sc.fact("hook-crun_device_cgroup", crun_cgroup)
        log = ctrs[0].poll_log()
        if crun_cgroup.endswith("/container"):
            sc.check("hook-crun: the crun container keeps the GPU (its device rules sit on <scope>/container)",
                     bool(log.last_alive) and not log.lost, log.summary())
            judge_poll(sc, ctrs[0], log, events, "one reload")
        else:
            sc.check("hook-crun: crun runs the container in the scope's own device cgroup, so the reload takes "
                     "the hook's grant (the loss reproduces)", log.lost, log.summary())
        if hierarchy() == "v2":
            for ctr in ctrs:
                scope_dir = "/sys/fs/cgroup/machine.slice/" + ctr.scope()
                sc.fact(f"{ctr.name}_device_programs", {
                    d[len(scope_dir) - len(ctr.scope()):]: len(bpfprog.query_device_program_ids(
                        bpfprog.open_cgroup_dir(d), effective=False))
                    for d in (scope_dir, scope_dir + "/container") if os.path.isdir(d)})
        log = ctrs[2].poll_log()
        sc.check("cdi-crun: the CDI container keeps the GPU (device in the spec, /dev/char link present)",
                 bool(log.last_alive) and not log.lost, log.summary())
        judge_poll(sc, ctrs[2], log, events, "one reload")
    finally:
        crun.remove_all()
