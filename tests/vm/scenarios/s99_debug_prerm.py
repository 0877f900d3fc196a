# vm: nvsymlinkd=off packages=upgrade timeout=600
"""debug: why prerm's prevention did nothing"""
import subprocess

from pkgsteps import Polled, operator, the_debs, unlink_nvidia_links
from vmguest import Scenario, load_fake_driver, mknod, sh

with Scenario() as sc:
    old_deb, new_deb = the_debs()
    load_fake_driver()
    gpu0 = mknod("/dev/nvidia0", 195, 0)
    mknod("/dev/nvidiactl", 195, 255)
    p = operator("dpkg", "-i", new_deb)
    sc.fact("install", (p.stdout + p.stderr)[-1500:])
    operator("systemctl", "stop", "nvsymlinkd.service")
    unlink_nvidia_links()
    c = Polled("dbg", nodes=[gpu0])
    p = operator("nvsymlinkd", "check", "--json")
    sc.fact("check", p.stdout[-4000:] + p.stderr[-1000:])
    p = subprocess.run(["sh", "-x", "/var/lib/dpkg/info/nvsymlinkd.prerm", "remove"], capture_output=True, text=True,
                       env=dict(__import__("pkgsteps").OPERATOR_ENV, DPKG_MAINTSCRIPT_PACKAGE="nvsymlinkd",
                                DPKG_ROOT=""))
    sc.fact("prerm", f"rc={p.returncode}\n" + p.stdout[-3000:] + p.stderr[-4000:])
    p = operator("nvsymlinkd", "check")
    sc.fact("check_after", p.stdout[-2000:] + p.stderr[-1000:])
    sc.check("debug ran", True)
    c.delete()
