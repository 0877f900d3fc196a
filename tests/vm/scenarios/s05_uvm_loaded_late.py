"""Scenario 5: nvidia-uvm loaded late. A GPU container starts while only the nvidia module is
loaded; then nvidia-uvm is inserted and its node made. The /dev/char link for uvm appears and
`nvsymlinkd check` reports the container that was not given uvm (exit 1, at-risk-uvm-missing).
"""
# vm: nvsymlinkd=deb timeout=300
import os

from tests.vm.guest.vmguest import (
    Scenario,
    expect_nvsymlinkd,
    load_fake_driver,
    load_fake_uvm,
    mknod,
    nvsymlinkd,
    start_gpu_container,
    wait_for,
)

with Scenario() as sc:
    expect_nvsymlinkd(sc)
    load_fake_driver()
    nodes = [mknod("/dev/nvidia0", 195, 0), mknod("/dev/nvidiactl", 195, 255)]
    for node in nodes:
        ok, _ = wait_for(lambda node=node: os.path.realpath(node.char_link) == node.path, timeout=15)
        sc.check(f"{node.char_link} -> {node.path} appeared", bool(ok))
    ctr = start_gpu_container("gpu-s05", nodes)
    sc.expect_open(ctr, "/dev/nvidia0", "OK", "at start")
    before = nvsymlinkd("check", "gpu-s05")
    sc.check("nvsymlinkd check gpu-s05 before uvm: no uvm finding", "uvm" not in before.stdout,
             f"exit {before.returncode}")
    uvm = mknod("/dev/nvidia-uvm", load_fake_uvm(), 0)
    ok, waited = wait_for(lambda: os.path.realpath(uvm.char_link) == uvm.path, timeout=15)
    sc.check(f"{uvm.char_link} -> /dev/nvidia-uvm appeared after the late insmod", bool(ok),
             f"after {waited:.2f} s")
    sc.timing("uvm_link_s", waited)
    after = nvsymlinkd("check", "gpu-s05")
    sc.check("nvsymlinkd check gpu-s05 exits 1 and reports at-risk-uvm-missing",
             after.returncode == 1 and "at-risk-uvm-missing" in after.stdout,
             f"exit {after.returncode}: {(after.stdout + after.stderr).strip()[-600:]}")
    sc.expect_open(ctr, "/dev/nvidia-uvm", "ENOENT", "(not given to the container)")
