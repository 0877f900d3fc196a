"""Frozen dataclasses for the modules `nvsymlinkd sync` imports, without the dataclasses module at run time.

`dataclasses` imports inspect (and with it ast, dis, tokenize: ~6 ms) and compiles six methods for
each class (~0.4 ms a class): together a sixth of a `nvsymlinkd sync` process (issue 16: its wall
near a bare interpreter's). The value classes on sync's path (config, the snapshot, the plan, the
driver info, device rules) are declared exactly as before, `@dataclass(frozen=True)` with
annotations, defaults and `field(default_factory=...)`, but import those names from here: type
checkers see the standard library's (the TYPE_CHECKING branch), and at run time a class gets the
same behaviour from shared functions: __init__ by position or keyword with the defaults, then
__post_init__; __repr__, __eq__ (same class, fields equal) and __hash__ over the fields, as
dataclasses writes them for eq=True, frozen=True; assigning or deleting a field raises
FrozenInstanceError (an AttributeError); replace() and fields() as in dataclasses.

Only what those classes use: frozen=True, fields with a default or a default_factory, no
inheritance between them, no ClassVar, no InitVar. Anything else raises TypeError at import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dataclasses import FrozenInstanceError as FrozenInstanceError
    from dataclasses import dataclass as dataclass
    from dataclasses import field as field
    from dataclasses import fields as fields
    from dataclasses import replace as replace
else:
    _MISSING = object()

    class FrozenInstanceError(AttributeError):
        """dataclasses.FrozenInstanceError's twin: a field of a frozen instance assigned or deleted."""

    class Field:
        __slots__ = ("name", "default", "default_factory")

        def __init__(self, default=_MISSING, default_factory=_MISSING):
            if default is not _MISSING and default_factory is not _MISSING:
                raise ValueError("cannot specify both default and default_factory")
            self.name = None
            self.default = default
            self.default_factory = default_factory

        def __repr__(self):
            return f"Field(name={self.name!r})"

    def field(*, default=_MISSING, default_factory=_MISSING):
        return Field(default, default_factory)

    def fields(class_or_instance):
        cls = class_or_instance if isinstance(class_or_instance, type) else type(class_or_instance)
        try:
            return cls.__record_fields__
        except AttributeError:
            raise TypeError("must be called with a dataclass type or instance") from None

    def replace(obj, **changes):
        for f in fields(obj):
            if f.name not in changes:
                changes[f.name] = obj.__dict__[f.name]
        return obj.__class__(**changes)

    def dataclass(cls=None, *, frozen=False):
        if cls is not None or not frozen:
            raise TypeError("nvsymlinkd.record.dataclass: only @dataclass(frozen=True)")
        return _frozen

    def _frozen(cls):
        if any(hasattr(base, "__record_fields__") for base in cls.__mro__[1:]):
            raise TypeError(f"{cls.__qualname__}: no inheritance between record classes")
        annotations = cls.__dict__.get("__annotations__", {})
        found = []
        for name, kind in annotations.items():
            if "ClassVar" in str(kind) or "InitVar" in str(kind):
                raise TypeError(f"{cls.__qualname__}.{name}: ClassVar and InitVar are not supported")
            value = cls.__dict__.get(name, _MISSING)
            f = value if isinstance(value, Field) else Field(default=value)
            f.name = name
            if f.default is not _MISSING and f.default.__class__.__hash__ is None:
                # dataclasses' rule (3.11+): an unhashable default (list, dict, set) would be one object
                # shared by every instance
                raise ValueError(f"mutable default {type(f.default)} for field {name} is not allowed: "
                                 "use default_factory")
            if f.default is _MISSING:
                if name in cls.__dict__:
                    delattr(cls, name)  # a default_factory's Field: no class attribute (as dataclasses)
            else:
                setattr(cls, name, f.default)
            if found and not _has_default(f) and _has_default(found[-1]):
                raise TypeError(f"non-default argument {name!r} follows default argument")
            found.append(f)
        _build(cls, tuple(found))
        return cls

    def _has_default(f):
        return f.default is not _MISSING or f.default_factory is not _MISSING

    def _build(cls, record_fields):
        names = tuple(f.name for f in record_fields)
        count = len(names)
        qualname = cls.__qualname__
        post_init = getattr(cls, "__post_init__", None)

        def __init__(self, *args, **kwargs):
            if not kwargs and len(args) == count:  # every field given by position: the common case
                self.__dict__.update(zip(names, args))
            else:
                if len(args) > count:
                    raise TypeError(f"{qualname}.__init__() takes {count + 1} positional arguments but "
                                    f"{len(args) + 1} were given")
                values = dict(zip(names, args))
                for key, value in kwargs.items():
                    if key not in names:
                        raise TypeError(f"{qualname}.__init__() got an unexpected keyword argument {key!r}")
                    if key in values:
                        raise TypeError(f"{qualname}.__init__() got multiple values for argument {key!r}")
                    values[key] = value
                for f in record_fields:
                    if f.name not in values:
                        if f.default is not _MISSING:
                            values[f.name] = f.default
                        elif f.default_factory is not _MISSING:
                            values[f.name] = f.default_factory()
                        else:
                            raise TypeError(f"{qualname}.__init__() missing 1 required positional argument: "
                                            f"{f.name!r}")
                self.__dict__.update((name, values[name]) for name in names)  # in field order, as dataclasses
            if post_init is not None:
                self.__post_init__()

        def _values(self):
            d = self.__dict__
            return tuple(d[name] for name in names)

        def __repr__(self):
            d = self.__dict__
            return f"{type(self).__qualname__}(" + ", ".join(f"{name}={d[name]!r}" for name in names) + ")"

        def __eq__(self, other):
            if other.__class__ is self.__class__:
                return _values(self) == _values(other)
            return NotImplemented

        def __hash__(self):
            return hash(_values(self))

        def __setattr__(self, name, value):
            if type(self) is cls or name in names:
                raise FrozenInstanceError(f"cannot assign to field {name!r}")
            object.__setattr__(self, name, value)

        def __delattr__(self, name):
            if type(self) is cls or name in names:
                raise FrozenInstanceError(f"cannot delete field {name!r}")
            object.__delattr__(self, name)

        own = cls.__dict__
        # a class that writes __eq__ gets __hash__ = None from Python: not a hash of its own
        explicit_hash = own.get("__hash__", None) is not None or ("__hash__" in own and "__eq__" not in own)
        for method in (__init__, __repr__, __eq__, __hash__, __setattr__, __delattr__):
            method.__qualname__ = f"{qualname}.{method.__name__}"
            name = method.__name__
            if name in ("__init__", "__repr__", "__eq__") and name in own or name == "__hash__" and explicit_hash:
                continue  # what the class writes itself wins, as with dataclasses
            setattr(cls, name, method)
        cls.__record_fields__ = record_fields
        cls.__match_args__ = names
