"""A cheaper constructor for the frozen dataclasses a policy tick makes per model.

The constructor `dataclass(frozen=True)` generates sets each field through
`object.__setattr__` (the class's own `__setattr__` refuses): a call per field. A
tick over 10,000 models makes about a dozen such objects per model (facts, signals,
states, estimates, rule outcomes), a few microseconds each. `quick_init` replaces
that constructor with one of the same signature that stores each field in the
instance's `__dict__` directly, in the class's field order (about half the time;
the dictionary keeps sharing the class's keys, 64 bytes more an instance): the
class stays frozen (assignment still raises), and its equality, hash and repr are
the dataclass's, over the same field values.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

T = TypeVar("T")

_NOTHING = object()  # a default_factory field left out


def quick_init(cls: type[T]) -> type[T]:
    """Give the frozen dataclass `cls` a constructor that stores its fields in the
    instance's `__dict__` (same parameters, defaults and factories). Only plain frozen
    dataclasses: no slots, `__post_init__`, keyword-only or `init=False` fields."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen:
        raise TypeError(f"{cls.__name__}: quick_init takes a frozen dataclass")
    if "__slots__" in cls.__dict__ or hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__}: quick_init takes no slots and no __post_init__")
    env: dict[str, object] = {"_NOTHING": _NOTHING}
    args, factories = [], []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if not f.init or f.kw_only:
            raise TypeError(f"{cls.__name__}.{f.name}: quick_init takes init, positional fields")
        if f.default is not dataclasses.MISSING:
            env[f"_default_{f.name}"] = f.default
            args.append(f"{f.name}=_default_{f.name}")
        elif f.default_factory is not dataclasses.MISSING:
            env[f"_factory_{f.name}"] = f.default_factory
            args.append(f"{f.name}=_NOTHING")
            factories.append(f"    if {f.name} is _NOTHING:\n"
                             f"        {f.name} = _factory_{f.name}()\n")
        else:
            args.append(f.name)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    source = (f"def __init__(self, {', '.join(args)}):\n{''.join(factories)}"
              "    __d = self.__dict__\n" + "".join(f"    __d[{n!r}] = {n}\n" for n in names))
    exec(source, env)
    init = env["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"  # type: ignore[attr-defined]
    init.__annotations__ = dict(cls.__init__.__annotations__)  # type: ignore[attr-defined, misc]
    cls.__init__ = init  # type: ignore[assignment, misc]
    return cls
