"""Doing: apply a Plan with syscalls, atomically and without clobbering.

- create: symlink(2) at the final name; it fails rather than overwrite.
- replace: symlink under a temporary name in the same directory, then
  rename(2) over the old link, after checking the old link is still the one
  we planned to replace.
- remove: unlink only if the link still has the text we planned on.
- create-node: mknod under a temporary name, chown and chmod it, then link(2)
  it to the final name (fails if anything appeared there) and drop the
  temporary name, so no node is ever visible with the wrong owner or mode.
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat
from dataclasses import dataclass

from nvsymlinkd.hostroot import HostRoot
from nvsymlinkd.linkplan import CREATE, CREATE_NODE, REMOVE, REPLACE, Action, Plan

TMP_PREFIX = ".nvsymlinkd-tmp-"


@dataclass(frozen=True)
class Outcome:
    action: Action
    error: str | None = None  # None: applied (or nothing to do)
    raced: bool = False  # another writer changed the path between planning and applying

    def to_json(self) -> dict:
        out = self.action.to_json()
        if self.error is not None:
            out["error"] = self.error
        return out


class ChangedUnderUs(Exception):
    """The path is no longer what the plan saw; the next sync will re-plan."""


def apply_plan(root: HostRoot, plan: Plan) -> list:
    outcomes = []
    for action in plan.actions:
        if not action.changes:
            outcomes.append(Outcome(action))
            continue
        try:
            _APPLY[action.action](root, action)
        except ChangedUnderUs as exc:
            outcomes.append(Outcome(action, f"changed while applying ({exc}); next sync re-plans", raced=True))
        except OSError as exc:
            outcomes.append(Outcome(action, _describe(exc)))
        else:
            outcomes.append(Outcome(action))
    return outcomes


def _ensure_dir(root: HostRoot, inside_dir: str) -> None:
    real = root.path(inside_dir)
    try:
        st = os.lstat(real)
    except FileNotFoundError:
        parent = posixpath.dirname(inside_dir)
        if parent != inside_dir:
            _ensure_dir(root, parent)
        try:
            os.mkdir(real, 0o755)
        except FileExistsError:
            pass
        return
    if not stat.S_ISDIR(st.st_mode):
        raise ChangedUnderUs(f"{inside_dir} is not a directory")


def _tmp_name(real: str) -> str:
    d, base = os.path.split(real)
    return os.path.join(d, f"{TMP_PREFIX}{os.getpid()}-{base}")


def _current_link_text(real: str) -> str | None:
    try:
        return os.readlink(real)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.EINVAL):
            return None
        raise


def _create(root: HostRoot, a: Action) -> None:
    _ensure_dir(root, posixpath.dirname(a.link))
    try:
        os.symlink(a.target, root.path(a.link))
    except FileExistsError:
        raise ChangedUnderUs(f"{a.link} appeared")


def _replace(root: HostRoot, a: Action) -> None:
    real = root.path(a.link)
    if _current_link_text(real) != a.previous:
        raise ChangedUnderUs(f"{a.link} no longer points to {a.previous}")
    tmp = _tmp_name(real)
    _unlink_quietly(tmp)
    os.symlink(a.target, tmp)
    try:
        os.replace(tmp, real)
    except BaseException:
        _unlink_quietly(tmp)
        raise


def _remove(root: HostRoot, a: Action) -> None:
    real = root.path(a.link)
    if _current_link_text(real) != a.previous:
        raise ChangedUnderUs(f"{a.link} no longer points to {a.previous}")
    os.unlink(real)


def _create_node(root: HostRoot, a: Action) -> None:
    _ensure_dir(root, posixpath.dirname(a.target))
    real = root.path(a.target)
    major, minor = (int(x) for x in a.device.split()[1].split(":"))
    tmp = _tmp_name(real)
    _unlink_quietly(tmp)
    os.mknod(tmp, stat.S_IFCHR | 0o600, os.makedev(major, minor))
    try:
        os.chown(tmp, a.node_uid, a.node_gid)
        os.chmod(tmp, a.node_mode)
        try:
            os.link(tmp, real)
        except FileExistsError:
            raise ChangedUnderUs(f"{a.target} appeared")
    finally:
        _unlink_quietly(tmp)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _describe(exc: OSError) -> str:
    if exc.errno == errno.EROFS:
        return "read-only file system"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied (run as root with CAP_MKNOD for nodes)"
    return exc.strerror or str(exc)


_APPLY = {CREATE: _create, REPLACE: _replace, REMOVE: _remove, CREATE_NODE: _create_node}
