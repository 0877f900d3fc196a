"""Real output for docs/troubleshooting.md: `nvsymlinkd check`, `repair` and `sync` run on a fake
host tree with real runc containers (the same fixtures as tests/test_check_runc.py), one scenario per
finding kind. Needs root, runc and busybox-static (.ci/apt.d/check.txt) and a cgroup v1 devices
controller (hybrid hosts like CI).

    .venv/bin/python -m tests.docs_examples          # prints every scenario's commands and output

The fake root's path is shown as ROOT; container ids are the scenario names.
"""

import subprocess
import sys
import tempfile
from pathlib import Path

from tests.runcfixture import RuncHost, device_node, device_rule

GPU0 = dict(rules=[device_rule(195, 0)], nodes=[device_node("/dev/nvidia0", 195, 0)],
            env=["NVIDIA_VISIBLE_DEVICES=0"])


def cli(host, *argv):
    proc = subprocess.run([sys.executable, "-m", "nvsymlinkd", "--root", str(host.root), *argv],
                          capture_output=True, text=True, timeout=120)
    shown = " ".join(["nvsymlinkd", *argv])
    out = (proc.stdout + proc.stderr).replace(str(host.root), "ROOT").rstrip()
    print(f"$ {shown}\n{out}\n(exit {proc.returncode})\n")


def scenario(title):
    print(f"===== {title}")


def main() -> int:
    runc = subprocess.run(["sh", "-c", "command -v runc"], capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        host = RuncHost(Path(tmp), runc)
        try:
            scenario("dev-char: links missing")
            cli(host, "check", "--no-bus")
            cli(host, "sync")
            cli(host, "check", "--no-bus", "--no-host")

            scenario("lost")
            c = host.run("gpu-lost", **GPU0)
            c.deny("c 195:0 rw")
            cli(host, "check", "--no-bus", "--no-host", "gpu-lost")
            cli(host, "repair", "--dry-run", "gpu-lost")
            cli(host, "repair", "gpu-lost")
            cli(host, "check", "--no-bus", "--no-host", "gpu-lost")

            scenario("denied")
            host.run("gpu-never", nodes=[device_node("/dev/nvidia0", 195, 0), device_node("/dev/nvidiactl", 195, 255)],
                     env=["NVIDIA_VISIBLE_DEVICES=0"])
            cli(host, "check", "--no-bus", "--no-host", "gpu-never")
            cli(host, "repair", "gpu-never")

            scenario("at-risk-not-in-spec")
            c = host.run("gpu-hook", rules=[device_rule(195, 0)],
                         nodes=[device_node("/dev/nvidia0", 195, 0), device_node("/dev/nvidia1", 195, 1)])
            c.allow("c 195:1 rw")
            cli(host, "check", "--no-bus", "--no-host", "gpu-hook")

            scenario("at-risk-scope")
            scope = "runc-gpu-scope.scope"
            host.fake.write(f"/run/systemd/transient/{scope}",
                            "# transient\n[Scope]\nDevicePolicy=strict\nDeviceAllow=\n"
                            "DeviceAllow=/dev/char/1:3 rwm\nDeviceAllow=char-pts rwm\n")
            host.run("gpu-scope", driver="systemd", **GPU0)
            cli(host, "check", "--no-bus", "--no-host", "gpu-scope")

            scenario("at-risk-uvm-missing")
            host.fake.proc_devices({"nvidia-frontend": 195, "nvidia-uvm": 509})
            host.fake.node("/dev/nvidia-uvm", 509, 0)
            cli(host, "sync")
            host.run("gpu-nouvm", **GPU0)
            cli(host, "check", "--no-bus", "--no-host", "gpu-nouvm")

            scenario("unknown: the container's cgroup cannot be read")
            c = host.run("gpu-gone", **GPU0)
            # the runtime's view stays, the init process is another one's now: its cgroup is not there
            (host.root / "proc" / str(c.pid)).unlink()
            (host.root / "proc" / str(c.pid)).mkdir()
            (host.root / "proc" / str(c.pid) / "cgroup").write_text("12:devices:/no-such-cgroup\n0::/no-such-cgroup\n")
            (host.root / "proc" / str(c.pid) / "stat").write_text(Path(f"/proc/{c.pid}/stat").read_text())
            cli(host, "check", "--no-bus", "--no-host", "gpu-gone")

            scenario("link-keepers: nvidia-ctk's udev rule")
            host.fake.write("/lib/udev/rules.d/71-nvidia-dev-char.rules",
                            'ACTION=="add", DEVPATH=="/bus/pci/drivers/nvidia", '
                            'RUN+="/usr/bin/nvidia-ctk system create-dev-char-symlinks --create-all"\n')
            (host.root / "dev/char/195:3").unlink()  # nvidia-ctk's links are absolute
            host.fake.symlink("/dev/char/195:3", "/dev/nvidia3")
            cli(host, "sync", "--dry-run")
            cli(host, "check", "--no-bus", "gpu-lost")
        finally:
            host.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
