"""Real runc containers (busybox rootfs, cgroupfs driver) seen through a fake host tree.

The fake tree (tests/fakehost.py) holds the host's NVIDIA view: /proc/devices
and mknod'ed /dev/nvidia* nodes (no driver behind them, so an allowed open
gives ENXIO and a denied one EPERM). The real kernel parts are linked in:
  ROOT/sys/fs/cgroup -> /sys/fs/cgroup   (the real device cgroups runc programs)
  ROOT/proc/<pid>    -> /proc/<pid>      (each container's init, linked when it starts)
runc's state root is ROOT/run/runc, where discovery looks for plain runc.

A container run with `driver="systemd"` stands for one a systemd-driver runc made (the tests' mock
systemd owns its scope): runc runs it with cgroupfs in a directory named as that scope
(runc-<id>.scope), under a root of its own outside the tree, and the fixture publishes runc's
state.json into ROOT/run/runc/<id>/ with the record a systemd-driver runc writes there
(`config.cgroups.Systemd`, `scope_prefix`, `name`: libcontainer/configs/cgroup_linux.go, specconv
CreateCgroupConfig), once runc has written its own (and exec.fifo while it is created). runc itself
refuses to load a Systemd record without systemd running, so its calls go to its own root.

Every container is killed and deleted, and its cgroups removed, at teardown,
even when the test failed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

from tests.fakehost import FakeHost

BUSYBOX = "/bin/busybox"  # busybox-static: runs in an empty rootfs
APPLETS = ("sh", "cat", "sleep", "mknod", "ls", "echo", "true")
CGROUP_V1 = "/sys/fs/cgroup"


def device_rule(major, minor, access="rw", allow=True, dev_type="c") -> dict:
    return {"allow": allow, "type": dev_type, "major": major, "minor": minor, "access": access}


def device_node(path, major, minor) -> dict:
    return {"path": path, "type": "c", "major": major, "minor": minor, "fileMode": 0o666, "uid": 0, "gid": 0}


class RuncContainer:
    def __init__(self, host: RuncHost, cid: str, bundle: Path, cgroups_path: str, driver: str = "cgroupfs"):
        self.host = host
        self.id = cid
        self.bundle = bundle
        self.cgroups_path = cgroups_path
        self.driver = driver
        # runc's own root: the tree's /run/runc, or for a systemd stand-in one outside it (see the module doc)
        self.runc_root = host.state_root if driver == "cgroupfs" else host.base / "runc-systemd"
        self.pid = None

    def state(self) -> dict:
        return json.loads((self.runc_root / self.id / "state.json").read_text())

    def runc(self, *argv, **kw) -> subprocess.CompletedProcess:
        """A runc command on this container's runc root; a systemd stand-in's published record follows it."""
        proc = self.host.runc(*argv, root=self.runc_root, **kw)
        self.publish()
        return proc

    def publish(self) -> None:
        """A systemd stand-in: runc's state.json as a systemd-driver runc records it, in the tree's /run/runc
        (written as runc writes it: a new file renamed into place), exec.fifo while runc's is there."""
        if self.driver == "cgroupfs":
            return
        mirror = self.host.state_root / self.id
        real = self.runc_root / self.id
        if not (real / "state.json").exists():
            shutil.rmtree(mirror, ignore_errors=True)
            return
        doc = self.state()
        doc["config"]["cgroups"].update({"Systemd": True, "scope_prefix": "runc", "name": self.id})
        mirror.mkdir(parents=True, exist_ok=True)
        fifo = mirror / "exec.fifo"
        if (real / "exec.fifo").exists() and not fifo.exists():
            os.mkfifo(fifo, 0o622)
        tmp = mirror / "state-publish.json"
        tmp.write_text(json.dumps(doc))
        os.rename(tmp, mirror / "state.json")
        if not (real / "exec.fifo").exists() and fifo.exists():
            fifo.unlink()

    def devices_dir(self) -> Path:
        return Path(CGROUP_V1) / "devices" / self.cgroups_path.lstrip("/")

    def devices_list(self) -> str:
        return (self.devices_dir() / "devices.list").read_text()

    def allow(self, rule: str) -> None:
        """Grant like the NVIDIA hook does: a direct write, not through the spec."""
        (self.devices_dir() / "devices.allow").write_text(rule + "\n")

    def deny(self, rule: str) -> None:
        (self.devices_dir() / "devices.deny").write_text(rule + "\n")

    def exec(self, *argv) -> subprocess.CompletedProcess:
        return self.host.runc("exec", self.id, *argv, check=False, root=self.runc_root)

    def open_error(self, path: str, rw: bool = False) -> str:
        """Ground truth from inside: 'ENXIO' (allowed, no driver), 'EPERM' (denied by the cgroup) or the text.

        rw: open O_RDWR (the shell's `<>`), as CUDA opens /dev/nvidia*; else O_RDONLY (cat).
        """
        command = f": <>{path}" if rw else f"cat {path} </dev/null"
        proc = self.exec("sh", "-c", command)
        text = proc.stderr + proc.stdout
        if "No such device or address" in text:
            return "ENXIO"
        if "Operation not permitted" in text:
            return "EPERM"
        return f"rc={proc.returncode}: {text.strip()}"


class RuncHost:
    def __init__(self, base: Path, runc: str):
        self.base = Path(base)
        self.runc_bin = runc
        self.fake = FakeHost(self.base / "root")
        self.root = self.fake.root
        self.state_root = self.root / "run" / "runc"
        self.state_root.mkdir(parents=True, exist_ok=True)
        (self.root / "sys" / "fs").mkdir(parents=True, exist_ok=True)
        os.symlink(CGROUP_V1, self.root / "sys" / "fs" / "cgroup")
        self.parent = f"/nvsymlinkd-test-{uuid.uuid4().hex[:8]}"
        self.containers: list = []
        self.fake.proc_devices({"nvidia-frontend": 195})
        for minor in range(4):
            self.fake.node(f"/dev/nvidia{minor}", 195, minor)
        self.fake.node("/dev/nvidiactl", 195, 255)

    def runc(self, *argv, check=True, timeout=60, root: Path | None = None, **kw) -> subprocess.CompletedProcess:
        proc = subprocess.run([self.runc_bin, "--root", str(root or self.state_root), *argv], capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL, **kw)
        if check and proc.returncode != 0:
            raise AssertionError(f"runc {' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def bundle(self, cid: str, rules=(), nodes=(), env=(), hooks=None, cgroup_leaf=None, args=None,
               annotations=None, bundle_dir: Path | None = None, caps=()) -> tuple:
        # inside the tree: the bundle label maps back (bundle_dir: another place in it, e.g. ROOT/tmp/ID)
        bundle = bundle_dir or self.root / "var" / "lib" / "bundles" / cid
        rootfs = bundle / "rootfs"
        for d in ("bin", "dev", "proc", "sys", "tmp"):
            (rootfs / d).mkdir(parents=True, exist_ok=True)
        shutil.copy2(BUSYBOX, rootfs / "bin" / "busybox")
        for applet in APPLETS:
            os.symlink("busybox", rootfs / "bin" / applet)
        self.runc("spec", "--bundle", str(bundle))
        spec = json.loads((bundle / "config.json").read_text())
        spec["process"]["terminal"] = False
        spec["process"]["args"] = list(args or ["sleep", "100000"])
        spec["process"]["env"] += list(env)
        spec["root"]["readonly"] = False
        caps_add, caps = caps, spec["process"]["capabilities"]  # caps: more capabilities (CAP_SYS_ADMIN: privileged)
        for key in caps:
            caps[key] = sorted(set(caps[key]) | {"CAP_MKNOD", *caps_add})
        spec["linux"]["resources"]["devices"] += list(rules)
        spec["linux"]["devices"] = list(nodes)
        cgroups_path = f"{self.parent}/{cgroup_leaf or cid}"
        spec["linux"]["cgroupsPath"] = cgroups_path
        if hooks:
            spec["hooks"] = hooks
        if annotations:
            spec["annotations"] = dict(annotations)
        (bundle / "config.json").write_text(json.dumps(spec, indent=1))
        return bundle, cgroups_path

    def container(self, cid: str, driver: str, kw: dict) -> RuncContainer:
        if driver == "systemd":  # a systemd stand-in lives in its scope's directory
            kw.setdefault("cgroup_leaf", f"runc-{cid}.scope")
        bundle, cgroups_path = self.bundle(cid, **kw)
        c = RuncContainer(self, cid, bundle, cgroups_path, driver)
        c.runc_root.mkdir(parents=True, exist_ok=True)
        self.containers.append(c)
        return c

    def run(self, cid: str, runc_env: dict | None = None, driver: str = "cgroupfs", **kw) -> RuncContainer:
        """runc_env: variables added to runc's own environment (a hook entry without `env` inherits it).
        driver: "systemd" for a systemd stand-in (see the module doc)."""
        c = self.container(cid, driver, kw)
        bundle = c.bundle
        # the container inherits runc's stdio: a file, never a pipe we would wait on
        with open(bundle / "runc.log", "w+") as log:
            proc = subprocess.run([self.runc_bin, "--root", str(c.runc_root), "run", "-d", "--bundle",
                                   str(bundle), cid], stdin=subprocess.DEVNULL, stdout=log, stderr=log, timeout=60,
                                  env={**os.environ, **runc_env} if runc_env else None)
            log.seek(0)
            if proc.returncode != 0:
                raise AssertionError(f"runc run {cid} failed ({proc.returncode}): {log.read().strip()}")
        self.link_proc(c)
        c.publish()
        return c

    def link_proc(self, c: RuncContainer) -> None:
        c.pid = c.state()["init_process_pid"]
        link = self.root / "proc" / str(c.pid)
        if not link.is_symlink():
            link.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(f"/proc/{c.pid}", link)

    def create_async(self, cid: str, driver: str = "cgroupfs", **kw):
        """`runc create` in the background (for a hook that is still running); returns (container, Popen).
        A systemd stand-in's record is published when its wait() sees runc done."""
        c = self.container(cid, driver, kw)
        log = open(c.bundle / "runc.log", "w")  # noqa: SIM115 - closed by the caller via proc
        proc = subprocess.Popen([self.runc_bin, "--root", str(c.runc_root), "create", "--bundle", str(c.bundle),
                                 cid], stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        log.close()  # the child holds its own copy
        if driver != "cgroupfs":
            wait = proc.wait

            def wait_and_publish(timeout=None):
                rc = wait(timeout=timeout)
                c.publish()
                return rc

            proc.wait = wait_and_publish  # type: ignore[method-assign]
        return c, proc

    def cleanup(self) -> None:
        for c in self.containers:
            subprocess.run([self.runc_bin, "--root", str(c.runc_root), "kill", c.id, "KILL"],
                           capture_output=True, timeout=30)
        for c in self.containers:
            for _ in range(50):
                proc = subprocess.run([self.runc_bin, "--root", str(c.runc_root), "delete", "-f", c.id],
                                      capture_output=True, text=True, timeout=30)
                if proc.returncode == 0 or "does not exist" in proc.stderr:
                    break
                time.sleep(0.1)
            c.publish()
        # v1/hybrid: one tree per controller; pure v2: the one tree at /sys/fs/cgroup itself
        tops = [Path(CGROUP_V1) / self.parent.lstrip("/")]
        tops += [Path(CGROUP_V1) / ctrl / self.parent.lstrip("/") for ctrl in os.listdir(CGROUP_V1)]
        for top in tops:
            if not top.is_dir():
                continue
            for leaf in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                _rmdir(leaf)
            _rmdir(top)


def _rmdir(path: Path) -> None:
    for _ in range(50):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.05)
