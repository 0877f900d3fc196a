"""nvsymlinkd.record's frozen classes behave as the standard library's frozen dataclasses do.

The same declarations made both ways, then every behaviour the project relies on compared:
construction by position and keyword, defaults and default factories, __post_init__, repr,
equality, hashing, frozen fields, replace(), fields(), and the errors of a wrong call.
"""

from __future__ import annotations

import dataclasses

import pytest

from nvsymlinkd import record
from nvsymlinkd.config import Config
from nvsymlinkd.devchar.model import HostSnapshot
from nvsymlinkd.host.devices import Access, Rule
from nvsymlinkd.host.driverinfo import DriverInfo, NodeOwnership


def declare(decorator, field):
    @decorator(frozen=True)
    class Point:
        x: int
        y: str = "y"
        tags: dict = field(default_factory=dict)
        items: tuple = ()

        def __post_init__(self) -> None:
            object.__setattr__(self, "y", self.y.strip())

        @property
        def label(self) -> str:
            return f"{self.x}{self.y}"

    return Point


STD = declare(dataclasses.dataclass, dataclasses.field)
OURS = declare(record.dataclass, record.field)

CALLS = [
    ((1,), {}),
    ((1, " a "), {}),
    ((1, "b", {"k": 1}, (2,)), {}),
    ((), {"x": 3}),
    ((4,), {"items": (1, 2), "y": "z"}),
    ((), {"tags": {"a": 1}, "x": 5}),
]


@pytest.mark.parametrize("args, kwargs", CALLS)
def test_construction_repr_eq_as_dataclasses(args, kwargs):
    std, ours = STD(*args, **kwargs), OURS(*args, **kwargs)
    assert repr(ours) == repr(std)
    assert vars(ours) == vars(std) and list(vars(ours)) == list(vars(std))
    assert ours == OURS(*args, **kwargs) and not ours != OURS(*args, **kwargs)
    assert ours.label == std.label
    assert (ours == std) is False  # another class: never equal, as between two dataclasses


def test_default_factory_gives_each_instance_its_own():
    a, b = OURS(1), OURS(1)
    assert a.tags == {} and a.tags is not b.tags
    assert OURS.items == () and not hasattr(OURS, "tags")  # as dataclasses leaves the class
    assert STD.items == () and not hasattr(STD, "tags")


def test_hash_and_frozen_as_dataclasses():
    ours, std = OURS(1, "a", items=(1,)), STD(1, "a", items=(1,))
    with pytest.raises(TypeError):
        hash(ours)  # a dict field, as with dataclasses
    with pytest.raises(TypeError):
        hash(std)
    assert hash(Rule(True, "c", 195, 0, Access("rw"))) == hash(Rule(True, "c", 195, 0, Access("rw")))
    assert {NodeOwnership(0, 0, 0o666), NodeOwnership()} == {NodeOwnership()}
    for obj, error in ((ours, record.FrozenInstanceError), (std, dataclasses.FrozenInstanceError)):
        assert issubclass(error, AttributeError)
        with pytest.raises(error):
            obj.x = 2
        with pytest.raises(error):
            del obj.x
        with pytest.raises(error):
            obj.other = 1


@pytest.mark.parametrize("args, kwargs", [
    ((), {}),                       # missing x
    ((1, "a", {}, (), 5), {}),      # too many
    ((1,), {"x": 2}),               # twice
    ((1,), {"nope": 2}),            # unknown
])
def test_wrong_calls_raise_type_error_as_dataclasses(args, kwargs):
    with pytest.raises(TypeError):
        STD(*args, **kwargs)
    with pytest.raises(TypeError):
        OURS(*args, **kwargs)


def test_replace_and_fields_as_dataclasses():
    ours, std = OURS(1, " a "), STD(1, " a ")
    assert vars(record.replace(ours, x=9)) == vars(dataclasses.replace(std, x=9))
    assert record.replace(ours, y=" b ").y == "b"  # through __init__ and __post_init__
    with pytest.raises(TypeError):
        record.replace(ours, nope=1)
    assert [f.name for f in record.fields(OURS)] == [f.name for f in dataclasses.fields(STD)]
    assert [f.name for f in record.fields(ours)] == ["x", "y", "tags", "items"]


def test_the_sync_path_classes():
    assert Config().with_overrides(driver_root="/run/nvidia/driver").driver_root == "/run/nvidia/driver"
    assert Config() == Config() and Config() != Config(repair="off")
    assert repr(Config()).startswith("Config(driver_root='/', dev_char_path='/dev/char', ")
    with pytest.raises(ValueError):
        Rule(True, "x", 1, 2, Access("r"))  # __post_init__ still checks
    assert Rule(True, "c", 1, 2, "rw").access == Access("rw")  # and converts
    assert DriverInfo().mig_minors == {} and DriverInfo().mig_minors is not DriverInfo().mig_minors
    assert HostSnapshot.__match_args__[:2] == ("majors", "nodes")


def test_only_frozen_classes_are_offered():
    with pytest.raises(TypeError):
        record.dataclass(frozen=False)

    with pytest.raises(TypeError):
        @record.dataclass(frozen=True)
        class Bad:
            a: int = 1
            b: int


def test_record_dataclass_refuses_a_mutable_default_like_dataclasses():
    import dataclasses

    from nvsymlinkd import record

    for default in ([], {}, set()):
        with pytest.raises(ValueError, match="mutable default"):
            dataclasses.dataclass(frozen=True)(type("A", (), {"__annotations__": {"x": "list"}, "x": default}))
        with pytest.raises(ValueError, match="mutable default"):
            record.dataclass(frozen=True)(type("B", (), {"__annotations__": {"x": "list"}, "x": default}))
    record.dataclass(frozen=True)(type("C", (), {"__annotations__": {"x": "tuple"}, "x": ()}))
