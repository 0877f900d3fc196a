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

from tests.vm.guest.stacks import Containerd, install_nvidia_toolkit, prove_prevention
from tests.vm.guest.vmguest import Scenario, expect_nvsymlinkd, gpu_nodes_linked

with Scenario() as sc:
    expect_nvsymlinkd(sc)
    gpu_nodes_linked(sc)
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
