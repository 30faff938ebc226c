"""`quick_init`: the cheaper constructor builds the same frozen dataclass instances."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field

import pytest

from gearshift.policies.economics import MoveEstimate
from gearshift.policies.quick_init import quick_init
from gearshift.policies.signals import EngineFacts, ModelFacts


@dataclass(frozen=True)
class Plain:
    a: int
    b: float | None = None
    c: dict[str, int] = field(default_factory=dict)
    d: str = "x"


@quick_init
@dataclass(frozen=True)
class Quick:
    a: int
    b: float | None = None
    c: dict[str, int] = field(default_factory=dict)
    d: str = "x"


@pytest.mark.parametrize("args, kwargs", [
    ((1,), {}), ((1, 2.5), {}), ((1,), {"d": "y"}), ((1, None, {"k": 1}, "z"), {}),
    ((), {"a": 3, "c": {"q": 2}})])
def test_same_fields_as_the_dataclass_constructor(args: tuple[object, ...],
                                                  kwargs: dict[str, object]) -> None:
    quick, plain = Quick(*args, **kwargs), Plain(*args, **kwargs)  # type: ignore[arg-type]
    assert dataclasses.astuple(quick) == dataclasses.astuple(plain)
    assert repr(quick).removeprefix("Quick") == repr(plain).removeprefix("Plain")
    assert quick == Quick(*args, **kwargs) and quick != Quick(-1)


def test_factories_give_each_instance_its_own_and_the_class_stays_frozen() -> None:
    one, two = Quick(1), Quick(2)
    assert one.c == {} and one.c is not two.c
    with pytest.raises(dataclasses.FrozenInstanceError):
        one.a = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        Quick()  # type: ignore[call-arg]  # a required field left out
    with pytest.raises(TypeError):
        Quick(1, e=2)  # type: ignore[call-arg]


def test_the_tick_s_classes_keep_their_signature_and_replace() -> None:
    assert list(inspect.signature(ModelFacts).parameters) == [
        f.name for f in dataclasses.fields(ModelFacts)]
    facts = EngineFacts(capacity_rps=2.0, cold_start_s=3.0)
    assert dataclasses.replace(facts, asleep=True) == EngineFacts(2.0, None, None, 3.0,
                                                                   asleep=True)
    assert ModelFacts(1).engines == {} and ModelFacts(1).engines is not ModelFacts(1).engines
    assert MoveEstimate.__init__.__qualname__ == "MoveEstimate.__init__"


@pytest.mark.parametrize("make", [
    lambda: dataclass(type("Mutable", (), {"__annotations__": {"a": int}})),
    lambda: dataclass(frozen=True, slots=True)(type("Slotted", (), {"__annotations__": {"a": int}})),
    lambda: dataclass(frozen=True)(type("Late", (), {"__annotations__": {"a": int},
                                                    "__post_init__": lambda self: None})),
    lambda: dataclass(frozen=True, kw_only=True)(type("Kw", (), {"__annotations__": {"a": int}})),
])
def test_refuses_what_it_cannot_build_alike(make: object) -> None:
    with pytest.raises(TypeError, match="quick_init"):
        quick_init(make())  # type: ignore[operator]
