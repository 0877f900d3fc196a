"""A scope's InvocationID read where systemd exports it, /run/systemd/units/invocation:UNIT (issue 34:
under a storm of daemon-reloads systemd answered no bus call and a container being created got no
drop-in; s29_reload_storm_creation in the VM). Nothing on the way that is not systemd's is followed."""

from __future__ import annotations

import os

import pytest

from nvsymlinkd.host.root import HostRoot
from nvsymlinkd.systemd import scopes

SCOPE = "libpod-0123abcd.scope"
ID = "5f3c0e7a9b2d4c61a8e0f1b2c3d4e5f6"
need_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


def exported(tmp_path, target=ID, scope=SCOPE):
    units = tmp_path / "run" / "systemd" / "units"
    units.mkdir(parents=True, exist_ok=True)
    os.symlink(target, units / f"invocation:{scope}")
    return units


def test_read_without_the_bus(tmp_path):
    exported(tmp_path)
    root = HostRoot(str(tmp_path))
    assert scopes.exported_invocation(root, SCOPE) == ID
    # use_bus=False: systemd cannot be asked, as during a reload; the exported id still answers
    assert scopes.scope_invocation(root, SCOPE, use_bus=False) == ID
    assert scopes.scope_invocation(root, "libpod-other.scope", use_bus=False) is None


@pytest.mark.parametrize("target", ["../../../etc/passwd", ID.upper(), ID[:31], ID + "0", ""])
def test_a_target_that_is_no_invocation_id(tmp_path, target):
    if not target:  # a regular file where systemd makes a symlink
        units = tmp_path / "run" / "systemd" / "units"
        units.mkdir(parents=True)
        (units / f"invocation:{SCOPE}").write_text(ID)
    else:
        exported(tmp_path, target)
    assert scopes.scope_invocation(HostRoot(str(tmp_path)), SCOPE, use_bus=False) is None


def test_a_name_that_is_no_scope(tmp_path):
    exported(tmp_path, scope="x/../y.scope".replace("/", "_"))
    assert scopes.exported_invocation(HostRoot(str(tmp_path)), "../units/invocation:x.scope") is None


def test_a_symlinked_directory_is_never_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(ID, elsewhere / f"invocation:{SCOPE}")
    (tmp_path / "run" / "systemd").mkdir(parents=True)
    os.symlink(str(elsewhere), tmp_path / "run" / "systemd" / "units")
    assert scopes.scope_invocation(HostRoot(str(tmp_path)), SCOPE, use_bus=False) is None


def test_a_directory_others_may_write_is_not_systemds(tmp_path):
    units = exported(tmp_path)
    os.chmod(units, 0o777)
    assert scopes.scope_invocation(HostRoot(str(tmp_path)), SCOPE, use_bus=False) is None
    os.chmod(units, 0o755)
    os.chmod(units.parent, 0o775)
    assert scopes.scope_invocation(HostRoot(str(tmp_path)), SCOPE, use_bus=False) is None


@need_root
def test_a_link_not_roots_is_not_systemds(tmp_path):
    units = exported(tmp_path)
    os.lchown(units / f"invocation:{SCOPE}", 1000, 1000)
    assert scopes.scope_invocation(HostRoot(str(tmp_path)), SCOPE, use_bus=False) is None
    os.lchown(units / f"invocation:{SCOPE}", 0, 0)
    os.chown(units, 1000, 0)
    assert scopes.scope_invocation(HostRoot(str(tmp_path)), SCOPE, use_bus=False) is None
