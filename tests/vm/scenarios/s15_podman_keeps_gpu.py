"""Scenario 15: Podman 4.3 (s14's containers: the NVIDIA OCI hook with crun and with runc, and
CDI) with the .deb installed and nvsymlinkd running: each GPU container is prevented or ok from
the start, `check --json` lists it ok as runtime podman in libpod-<id>.scope, and through 20
daemon-reloads, 2 daemon-reexecs and 10 `podman update --cpuset-cpus` (the default run 3, 2 and 2:
stacks.event_counts) gpupoll sees zero denied
opens (Podman has no daemon to restart). A plain (non-GPU) container is not listed as a GPU one
(the OCI hook runs for it too, and grants nothing); `repair` and `check` take the Podman name,
an id prefix and the scope; the journal tells runc's container's story once, naming it.
"""
# vm: nvsymlinkd=deb timeout=600 full=v1

from tests.vm.guest.stacks import Podman, install_nvidia_toolkit, prove_prevention
from tests.vm.guest.vmguest import Scenario, expect_nvsymlinkd, gpu_nodes_linked

with Scenario() as sc:
    expect_nvsymlinkd(sc)
    gpu_nodes_linked(sc)
    install_nvidia_toolkit()
    crun, runc = Podman("crun"), Podman("runc")
    sc.timing("podman_import_s", crun.start())
    try:
        # the plain container first: its new scope must not be what triggers the GPU ones' check
        plain = [crun.run_plain("web")]
        prove_prevention(sc, crun, [crun.run_gpu("hook-crun"), runc.run_gpu("hook-runc")], "podman", plain=plain)
    finally:
        crun.remove_all()
