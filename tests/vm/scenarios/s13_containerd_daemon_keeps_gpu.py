"""Scenario 13: containerd 1.6 as the CRI plugin drives it (s12's stack), with the .deb installed
and nvsymlinkd running: the container is prevented, `check --json` lists it ok as runtime
containerd in cri-containerd-<id>.scope, and through 20 daemon-reloads, 2 daemon-reexecs, 10
task updates (kubelet CPU manager's path; the default run 3, 2 and 2: stacks.event_counts) and a
containerd restart gpupoll sees zero denied opens.
The containers carry the CRI plugin's annotations (sandbox namespace/name, container name) and
64-hex ids: `repair` and `check` take namespace/pod/container, namespace/pod, an id prefix and the
scope, and the journal's entries carry POD_NAMESPACE, POD_NAME and CONTAINER_NAME. A plain
(non-GPU) container of another pod is not listed as a GPU one.
"""
# vm: nvsymlinkd=deb timeout=600 full=v1
import os

from tests.vm.guest.stacks import Containerd, install_nvidia_toolkit, prove_prevention
from tests.vm.guest.vmguest import Scenario, expect_nvsymlinkd, load_fake_driver, mknod, wait_for

with Scenario() as sc:
    expect_nvsymlinkd(sc)
    majors = load_fake_driver(uvm=True)
    nodes = [mknod("/dev/nvidia0", 195, 0), mknod("/dev/nvidiactl", 195, 255),
             mknod("/dev/nvidia-uvm", majors["nvidia-uvm"], 0)]
    for node in nodes:
        ok, _ = wait_for(lambda node=node: os.path.realpath(node.char_link) == node.path, timeout=15)
        sc.check(f"{node.char_link} -> {node.path}", bool(ok))
    install_nvidia_toolkit()
    stack = Containerd()
    sc.timing("containerd_start_and_import_s", stack.start())
    try:
        # the plain container first: its new scope must not be what triggers the GPU one's check
        plain = [stack.run_plain("web", k8s=("gpu-team", "web-0", "nginx"))]
        ctrs = [stack.run_gpu("gpu-ctr", k8s=("gpu-team", "trainer-0", "cuda"))]
        prove_prevention(sc, stack, ctrs, "containerd", plain=plain)
    finally:
        stack.remove_all()
