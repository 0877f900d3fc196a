"""What systemd will re-apply on the next daemon-reload: a container scope's DeviceAllow.

Sources, best first:
  1. D-Bus: org.freedesktop.systemd1.Scope.DeviceAllow/DevicePolicy of the
     unit (live value; one batch on the process's systemd client, systemd.client;
     DBUS_SYSTEM_BUS_ADDRESS honoured).
  2. Files systemd writes for transient units: /run/systemd/transient/<scope>,
     then its drop-ins (SetUnitProperties: /run/systemd/transient/<scope>.d/*.conf
     for a transient unit, /run/systemd/system.control/<scope>.d/*.conf for others)
     in name order; an empty `DeviceAllow=` resets the list.
Neither -> None: the caller reports `unknown` for this check. A bus that could not be
asked is an error the caller sees (ScopeReads.bus_error), never an empty answer.

Entry forms: systemd.deviceallow, which parses them and maps all but a plain /dev path (stat'ed
here, under the root, as systemd stats it).
"""

from __future__ import annotations

import asyncio
import errno
import os
import re
import stat
import time
from dataclasses import dataclass

from nvsymlinkd.containers.ocispec import MAX_SMALL_BYTES, read_bounded
from nvsymlinkd.host.devices import Access, Device, Rule
from nvsymlinkd.host.root import HostRoot
from nvsymlinkd.systemd.deviceallow import DeviceAllow

TRANSIENT_DIR = "/run/systemd/transient"
CONTROL_DIR = "/run/systemd/system.control"
# the unit directories after those two in systemd's search path that hold drop-ins for any unit: an
# administrator's (/etc) and the runtime one, where nvsymlinkd keeps a creating container's hook grant
# (systemd.dropin)
RUNTIME_UNIT_DIR = "/run/systemd/system"
UNIT_DIRS = ("/etc/systemd/system", RUNTIME_UNIT_DIR)
SCOPE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,250}\.scope")


@dataclass(frozen=True)
class ScopeDevices:
    scope: str
    source: str  # "dbus" or "files"
    policy: str  # auto, closed, strict
    entries: tuple  # DeviceAllow (path, access) as systemd holds them
    rules: tuple  # Rule (allow) for the entries we could map to numbers
    unmapped: tuple = ()  # entries we could not map (plain paths that do not resolve, ...)

    def covers(self, device: Device, access: Access) -> bool:
        """Would systemd's next apply allow this access? (one entry must cover every letter)"""
        if self.policy == "auto" and not self.entries:
            return True  # no device restriction at all
        return any(r.covers(device, access) for r in self.rules)


def unit_settings(text: str) -> tuple:
    """The DevicePolicy=/DeviceAllow= settings of one unit file or drop-in, in order: ("policy", value),
    ("allow", DeviceAllow), or ("allow", None) for an empty DeviceAllow= (which resets the list)."""
    out: list = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;[":
            continue
        key, sep, value = line.partition("=")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if len(value) >= 2 and value[0] == value[-1] == '"':
            value = value[1:-1]
        if key == "DevicePolicy":
            out.append(("policy", value or "auto"))
        elif key == "DeviceAllow":
            out.append(("allow", DeviceAllow.parse(value)))
    return tuple(out)


def _apply_settings(settings: tuple, entries: list, policy: list) -> None:
    for key, value in settings:
        if key == "policy":
            policy[:] = [value]
        elif value is None:
            entries.clear()
        else:
            entries.append(value)


def read_scope_files(root: HostRoot, scope: str, files=None) -> ScopeDevices | None:
    """The scope's DeviceAllow from its transient unit file and system.control drop-ins.

    files: a verify.cache.FileCache: each file parsed again only when its identity changed, the
    drop-in directory listed again only when it changed (the daemon's pass; `check` reads afresh).
    """
    if not SCOPE_NAME.fullmatch(scope):
        return None
    entries: list = []
    policy = ["auto"]
    found = False

    def settings_of(inside: str) -> tuple:
        if files is not None:
            return files.load(root.path(inside), unit_settings, MAX_SMALL_BYTES, str)  # type: ignore[no-any-return]
        return unit_settings(read_bounded(root.path(inside), MAX_SMALL_BYTES).decode("utf-8", "replace"))

    try:
        _apply_settings(settings_of(f"{TRANSIENT_DIR}/{scope}"), entries, policy)
        found = True
    except OSError:
        pass
    for path in _dropins(root, scope, files)[:256]:
        try:
            settings = settings_of(path)
        except OSError:
            continue
        _apply_settings(settings, entries, policy)
        found = True
    if not found:
        return None
    return ScopeDevices(scope, "files", policy[0], tuple(entries), (), ())


def read_unit_files(root: HostRoot, scope: str) -> ScopeDevices | None:
    """The scope's DevicePolicy and DeviceAllow as systemd's own files say them (read_scope_files' unit file
    and drop-ins, in the same order), read without the bus: the creation-time drop-in's wait, which must
    not wait on a systemd that answers no call while it reloads. systemd stores runc's Set in
    TRANSIENT_DIR/<scope>.d before it answers it (src/core/dbus-cgroup.c at v252.39, bus_cgroup_set_property:
    "DevicePolicy" 1644, "DeviceAllow" 1726, each through src/core/unit.c's unit_write_setting, 4360-4441:
    a temporary file renamed in), so these files know runc's policy as soon as the bus does. Every
    directory is opened without following a link and must be root's alone (open_root_dirs), every file a
    regular one, not a link: a file planted there could make an unrestricted scope read strict, and a
    drop-in then narrow it. None: no file names the scope, or something on the way is not systemd's (the
    caller writes nothing then)."""
    if not SCOPE_NAME.fullmatch(scope):
        return None
    entries: list = []
    policy = ["auto"]
    unit_file: list = []  # (directory fd, name): the transient unit file, read before the drop-ins
    chosen: dict = {}  # drop-in name -> its directory's fd: a name in an earlier directory hides a later one
    opened: list = []
    found = False
    try:
        for base in (CONTROL_DIR, TRANSIENT_DIR) + UNIT_DIRS:
            try:
                fd = open_root_dirs(root, base.strip("/").split("/"))
            except UnsafeDirectory:
                return None
            except OSError:
                continue
            opened.append(fd)
            if base == TRANSIENT_DIR:
                unit_file.append((fd, scope))
            try:
                dfd = _open_root_dir(fd, f"{scope}.d", f"{base}/{scope}.d")
            except UnsafeDirectory:
                return None
            except OSError:
                continue
            opened.append(dfd)
            for name in os.listdir(dfd):
                if name.endswith(".conf"):
                    chosen.setdefault(name, dfd)
        for dir_fd, name in unit_file + [(chosen[name], name) for name in sorted(chosen)[:256]]:
            text = _read_root_file(dir_fd, name)
            if text is False:
                return None
            if text is not None:
                _apply_settings(unit_settings(text), entries, policy)
                found = True
    finally:
        for fd in opened:
            os.close(fd)
    if not found:
        return None
    return ScopeDevices(scope, "files", policy[0], tuple(entries), (), ())


def _read_root_file(dir_fd: int, name: str):
    """The text of a regular file owned by root in the directory (never through a link); None when it is
    not there; False when it is there but not a file of root's."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0:
            return False
        return os.read(fd, MAX_SMALL_BYTES).decode("utf-8", "replace")
    finally:
        os.close(fd)


def _dropins(root: HostRoot, scope: str, files) -> list:
    """The scope's drop-ins as systemd reads them: every directory's *.conf in one name order, a name in an
    earlier directory hiding the same name in a later one. systemd writes the runtime properties of a
    transient unit (SetUnitProperties, `systemctl set-property`) to TRANSIENT_DIR/<unit>.d, whatever the
    runtime flag (src/core/unit.c, unit_drop_in_dir: "Redirect drop-ins for transient units always into
    the transient directory"); CONTROL_DIR/<unit>.d holds other units' runtime properties; UNIT_DIRS
    follow in the search path's order (src/core/unit.c, unit_file_find_dropin_paths over lookup_paths)."""
    chosen: dict = {}
    for base in (CONTROL_DIR, TRANSIENT_DIR) + UNIT_DIRS:
        directory = f"{base}/{scope}.d"
        if files is not None:
            listed = files.names(root.path(directory)) or ()
        else:
            try:
                listed = os.listdir(root.path(directory))
            except OSError:
                listed = ()
        for name in listed:
            if name.endswith(".conf"):
                chosen.setdefault(name, f"{directory}/{name}")
    return [chosen[name] for name in sorted(chosen)]


def map_entries(root: HostRoot, sd: ScopeDevices, majors) -> ScopeDevices:
    """Turn systemd's device specifiers into numeric allow rules."""
    rules, unmapped = [], []
    for entry in map(DeviceAllow.of_pair, sd.entries):
        rule = _map_one(root, entry, majors)
        if rule is None:
            unmapped.append(f"{entry.path} {entry.letters}")
        else:
            rules.extend(rule)
    return ScopeDevices(sd.scope, sd.source, sd.policy, sd.entries, tuple(rules), tuple(unmapped))


def _map_one(root: HostRoot, entry: DeviceAllow, majors) -> list | None:
    if entry.by_number:
        return entry.rules(majors.pairs)
    if entry.path.startswith("/dev/"):
        st = root.stat_resolved(entry.path)  # systemd stats these at apply time
        if st is None or not (stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)):
            return None
        dev_type = "c" if stat.S_ISCHR(st.st_mode) else "b"
        return [Rule(True, dev_type, os.major(st.st_rdev), os.minor(st.st_rdev), entry.letters)]
    return None


def bus_allowed(root: HostRoot) -> bool:
    """Ask the live systemd only for the real host, or when a bus address is given explicitly."""
    return root.is_real_root or bool(os.environ.get("DBUS_SYSTEM_BUS_ADDRESS"))


def read_scopes_bus(scopes) -> dict:
    """scope -> ScopeDevices for the scopes systemd knows (one batch on the process's systemd client);
    raises SystemdCallError when the bus is absent, refuses or does not answer in time."""
    from nvsymlinkd.systemd.client import shared

    scopes = [s for s in scopes if SCOPE_NAME.fullmatch(s)]
    if not scopes:
        return {}
    found = shared().scope_properties(scopes)
    out = {}
    for scope, props in found.items():
        sd = _scope_devices(scope, props)
        if sd is not None:
            out[scope] = sd
    return out


def _scope_devices(scope: str, props) -> ScopeDevices | None:
    """ScopeDevices of one scope from its properties, or None (systemd does not know it, or names no
    DeviceAllow: the files decide)."""
    if props is None:
        return None  # NoSuchUnit: not a systemd-managed container
    allow = props.get("DeviceAllow")
    policy = props.get("DevicePolicy")
    if allow is None:
        return None
    entries = tuple(map(DeviceAllow.of_pair, allow.value))
    return ScopeDevices(scope, "dbus", str(policy.value) if policy is not None else "auto", entries, ())


class ScopeReads(dict):
    """read_scopes' answer: scope -> ScopeDevices or None; bus_error: why systemd could not be asked
    (the unit files answered instead), None when it was asked or was not to be."""

    bus_error: str | None = None


# a bus read of the creation wait gives up after this long and leaves the rest of the wait to systemd's files:
# systemd answers no call while it reloads (a reload took ~8 s under TCG), and the drop-in must be written
# before the reload loads the scope's unit again (s29@v1: a 5 s wait wrote it after that, and lost)
BUS_READ_TIMEOUT = 1.0
# while systemd reloads, how often the wait looks whether the reload ended (its files wake it otherwise)
RELOAD_LOOK = 0.1


def _runtime_policy_in_files(sd: ScopeDevices | None) -> bool:
    """Files that say enough to act on without the bus: a policy and entries that are not half of runc's Set
    (`auto` with entries: DeviceAllow's file renamed in before DevicePolicy's; runc sends DevicePolicy
    first, libcontainer/cgroups/systemd/common.go:185-189 at v1.1.5, so this is another writer's moment)."""
    return sd is not None and not (sd.policy == "auto" and sd.entries)


async def _poll_bus(bus, scope: str, ready, timeout: float, interval: float, wake=None, files=None,
                    reloading=None) -> tuple:
    """(ScopeDevices or None, reads) on the client's connection: DevicePolicy and DeviceAllow (two small
    Gets, pipelined: a GetAll carries every cgroup property, and this is asked again and again) until
    ready(sd) or timeout; between reads, `wake`'s fd becoming readable (wait_for_scope), else `interval`.
    files() (systemd's own files, read first at every read) answers without the bus when ready says so of
    it; reloading() true: systemd answers nothing now, the bus is not asked (its files are read at each
    wake, and every RELOAD_LOOK whether the reload ended). None: systemd does not know the scope (or it
    went away)."""
    from nvsymlinkd.systemd import client

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    path = None
    reads = 0
    straddled = False
    while True:
        if files is not None:
            sd = files()
            if _runtime_policy_in_files(sd) and ready(sd):
                return sd, reads + 1
        if reloading is not None and reloading():
            reads += files is not None
            if loop.time() >= deadline:
                return sd if files is not None else None, reads
            await _wait(loop, wake, min(RELOAD_LOOK, deadline - loop.time()), interval)
            continue
        bus_timeout = client.CALL_TIMEOUT if files is None else BUS_READ_TIMEOUT
        if path is None:
            try:
                path = await client.get_unit(bus, scope, bus_timeout)
            except client.SystemdCallError as exc:
                if exc.error_name == client.NO_SUCH_UNIT:
                    return None, reads + 1
                raise
        try:
            policy, allow = await asyncio.gather(*(
                client.call(bus, "Get", "ss", [client.SCOPE, name], path=path, interface=client.PROPERTIES,
                            timeout=bus_timeout)
                for name in ("DevicePolicy", "DeviceAllow")))
        except client.SystemdCallError as exc:
            if exc.error_name is not None:  # an answer, and it is no: the unit is gone
                return None, reads + 1
            raise
        reads += 1
        entries = tuple(map(DeviceAllow.of_pair, allow[0].value))
        sd = ScopeDevices(scope, "dbus", str(policy[0].value), entries, ())
        if sd.policy == "auto" and entries and not straddled:
            # runc's Set sends DevicePolicy=strict with its entries in one SetUnitProperties, which systemd
            # applies whole; two Gets can still straddle it (the policy read before, the entries after):
            # `auto` with entries is read again once (a benchmark caught it: no drop-in for that container)
            straddled = True
            continue
        if ready(sd) or loop.time() >= deadline:
            return sd, reads
        await _wait(loop, wake, deadline - loop.time(), interval)


async def _wait(loop, wake, timeout: float, interval: float) -> None:
    if wake is None:
        await asyncio.sleep(min(interval, max(0.0, timeout)))
    else:
        await _readable(loop, wake, timeout)


async def _readable(loop, wake, timeout: float) -> None:
    """Until `wake`'s fd is readable (then drained) or `timeout` seconds have passed."""
    ready = loop.create_future()
    loop.add_reader(wake.fileno(), lambda: ready.done() or ready.set_result(None))
    try:
        await asyncio.wait_for(ready, timeout)
    except asyncio.TimeoutError:
        return
    finally:
        loop.remove_reader(wake.fileno())
    wake.wakes += 1
    wake.drain()


def wait_for_scope(root: HostRoot, scope: str, ready, timeout: float, interval: float,
                   use_bus: bool | None = None, wake=None, reloading=None) -> tuple:
    """(ScopeDevices, unmapped, or None when neither source knows the scope; reads) read again until
    ready(ScopeDevices) is true or `timeout` has passed: a scope the runtime is still setting up
    (containers.early). systemd's own files first (read_unit_files: they hold runc's Set before systemd
    answers it), then D-Bus on the process's systemd client (the live values), each bus read bounded by
    BUS_READ_TIMEOUT and none while reloading() says systemd reloads (it answers no call then); a bus
    that fails leaves the files for the time that is left. Read again when `wake` (a
    daemon.inotify.CreationWatch, armed before the first read) says the scope's transient drop-ins or the
    container's state changed, with no poll in between; without one, every `interval` seconds. reloading:
    by default the wake's (CreationWatch.reloading)."""
    if not SCOPE_NAME.fullmatch(scope):
        return None, 0
    if use_bus is None:
        use_bus = bus_allowed(root)
    if reloading is None:
        reloading = getattr(wake, "reloading", None)
    start = time.monotonic()
    if use_bus and not _in_running_loop():
        from nvsymlinkd.systemd import client

        try:
            sd, reads = client.shared().run(lambda bus: _poll_bus(
                bus, scope, ready, timeout, interval, wake, files=lambda: read_unit_files(root, scope),
                reloading=reloading))
            if sd is not None:
                return sd, reads
        except client.SystemdCallError:  # no bus, refused, timed out: the files are the fallback
            pass
    reads = 0
    while True:
        sd = read_unit_files(root, scope)
        reads += 1
        left = timeout - (time.monotonic() - start)
        if sd is None or (_runtime_policy_in_files(sd) and ready(sd)) or left <= 0:
            return sd, reads
        if wake is None:
            time.sleep(interval)
        else:
            wake.wait(left)


# systemd (the system manager) exports a started unit's InvocationID as the target of a symlink, made
# when the unit starts and removed when it stops (src/core/unit.c at v252: unit_export_invocation_id,
# unit_unlink_state_files); journald reads it there (src/journal/journald-context.c,
# client_context_read_invocation_id). systemd answers no bus call during a daemon-reload: under a storm of
# reloads the bus never said a new scope's id in time and its container got no drop-in (s29).
INVOCATION_DIR = ("run", "systemd", "units")
INVOCATION_ID = re.compile(r"[0-9a-f]{32}")


class UnsafeDirectory(OSError):
    """A directory on the way that is a link, not a directory, or not root's alone."""


def open_root_dirs(root: HostRoot, names: list[str], create: bool = False) -> int:
    """An fd of the directory <root>/NAME/NAME/...: every component opened with O_NOFOLLOW from the root's
    own directory, each a directory owned by root that no other user may write, as owner of the group or
    not (a planted directory would let its writer swap a file systemd reads, or one we read, for one of
    theirs); made 0755 where missing, when create. Raises UnsafeDirectory, or OSError (missing)."""
    fd = os.open(root.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    shown = ""
    try:
        for name in names:
            shown += "/" + name
            if create:
                try:
                    os.mkdir(name, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
            nfd = _open_root_dir(fd, name, shown)
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def _open_root_dir(dir_fd: int, name: str, shown: str) -> int:
    """An fd of the directory `name` in dir_fd, opened with O_NOFOLLOW: a directory owned by root that no other
    user may write. Raises UnsafeDirectory (a link, not a directory, not root's alone; `shown` names it), or
    OSError (missing)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeDirectory(exc.errno, f"{shown} is a symlink or not a directory: never followed") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        os.close(fd)
        raise UnsafeDirectory(errno.EPERM, f"{shown} is not a directory owned by root and writable by root alone")
    return fd


def exported_invocation(root: HostRoot, scope: str) -> str | None:
    """The InvocationID systemd exported for the unit (/run/systemd/units/invocation:UNIT), or None: not
    started, or anything on the way not systemd's (a symlink for a directory, a directory or the link
    not root's, a directory others may write: never followed, never trusted)."""
    if not SCOPE_NAME.fullmatch(scope):
        return None
    try:
        fd = open_root_dirs(root, list(INVOCATION_DIR))
    except OSError:
        return None
    try:
        link = f"invocation:{scope}"
        st = os.lstat(link, dir_fd=fd)
        if not stat.S_ISLNK(st.st_mode) or st.st_uid != 0:
            return None
        target = os.readlink(link, dir_fd=fd)
    except OSError:
        return None
    finally:
        os.close(fd)
    return target if INVOCATION_ID.fullmatch(target) else None


def scope_invocation(root: HostRoot, scope: str, use_bus: bool | None = None) -> str | None:
    """The scope's InvocationID (32 hex digits): as systemd exported it (exported_invocation), else as it
    says it on the bus now; None: systemd does not know the scope, or cannot be asked (no bus, a failed
    call, a caller on an event loop's thread)."""
    if not SCOPE_NAME.fullmatch(scope):
        return None
    exported = exported_invocation(root, scope)
    if exported is not None:
        return exported
    if use_bus is None:
        use_bus = bus_allowed(root)
    if not use_bus or _in_running_loop():
        return None
    from nvsymlinkd.systemd import client

    try:
        return client.shared().invocation_id(scope)
    except client.SystemdCallError:
        return None


def _by_number(sd: ScopeDevices) -> bool:
    """Every entry maps without looking at the host (/dev/char/M:m, char-*, char-NAME by /proc/devices)."""
    return all(DeviceAllow.of_pair(entry).by_number for entry in sd.entries)


def _in_running_loop() -> bool:
    """A caller on an event loop's thread (none today: the daemon verifies in worker threads) reads the
    files: a blocking bus call there would stall that loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def read_scopes(root: HostRoot, scopes, majors, use_bus: bool | None = None, cache=None) -> ScopeReads:
    """scope -> ScopeDevices (numeric rules mapped) or None when neither source knows it; the answer's
    bus_error says why systemd was not asked (the files answered for every scope then).

    cache: a verify.cache.VerifyCache: the same entries and /proc/devices map to the same rules (a plain
    /dev path is stat'ed every time).
    """
    from nvsymlinkd.systemd.client import SystemdCallError

    scopes = sorted(set(s for s in scopes if s))
    if use_bus is None:
        use_bus = bus_allowed(root) and not _in_running_loop()
    out = ScopeReads()
    live: dict = {}
    if use_bus:
        try:
            live = read_scopes_bus(scopes)
        except SystemdCallError as exc:  # the files answer; the caller says systemd did not
            out.bus_error = str(exc)
    for scope in scopes:
        sd = live.get(scope) or read_scope_files(root, scope, cache.files if cache is not None else None)
        if sd is None:
            out[scope] = None
        elif cache is not None and _by_number(sd):
            out[scope] = cache.memo("scope", scope, (sd, majors.pairs), lambda sd=sd: map_entries(root, sd, majors))[0]
        else:
            out[scope] = map_entries(root, sd, majors)
    return out
