"""`fast_init` builds the same frozen records as the dataclass's own `__init__`."""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass, field

import pytest

from gearshift.common.frozen_records import fast_init
from gearshift.policies.core import ModelState
from gearshift.policies.economics import MoveEstimate
from gearshift.policies.signals import EngineFacts, ModelFacts


def _record(decorate: bool) -> type:
    @dataclass(frozen=True)
    class Record:
        name: str
        rate: float | None = None
        tags: dict[str, str] = field(default_factory=dict)
        hidden: int = field(default=0, compare=False, repr=False)

    return fast_init(Record) if decorate else Record


CALLS = [(("a",), {}), (("a", 1.5), {}), ((), {"name": "b", "tags": {"k": "v"}, "hidden": 3}),
         (("c",), {"rate": None, "hidden": 7})]


@pytest.mark.parametrize(("args", "kwargs"), CALLS)
def test_same_fields_equality_hash_repr_as_the_dataclass_init(args: tuple, kwargs: dict) -> None:
    plain, fast = _record(False)(*args, **kwargs), _record(True)(*args, **kwargs)
    assert vars(fast) == vars(plain)
    assert repr(fast).split("Record", 1)[1] == repr(plain).split("Record", 1)[1]
    assert dataclasses.asdict(fast) == dataclasses.asdict(plain)
    assert fast == type(fast)(*args, **kwargs)
    assert dataclasses.replace(fast, rate=2.0).rate == 2.0
    assert dataclasses.replace(fast, rate=2.0) == type(fast)(**{**vars(fast), "rate": 2.0})


def test_frozen_and_default_factories_are_fresh() -> None:
    cls = _record(True)
    one, two = cls("a"), cls("a")
    assert one.tags == {} and one.tags is not two.tags
    with pytest.raises(dataclasses.FrozenInstanceError):
        one.rate = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        cls()
    with pytest.raises(TypeError):
        cls("a", unknown=1)


def test_the_policy_records_keep_their_semantics() -> None:
    ef = EngineFacts(capacity_rps=2.0, cold_start_s=30.0)
    facts = ModelFacts(gpus_per_replica=1, engines={"vllm": ef})
    assert facts == ModelFacts(1, engines={"vllm": EngineFacts(capacity_rps=2.0, cold_start_s=30.0)})
    assert facts.labels == {} and facts.headroom == 0.2
    assert hash(ef) == hash(EngineFacts(capacity_rps=2.0, cold_start_s=30.0))
    assert pickle.loads(pickle.dumps(ef)) == ef
    state = ModelState("vllm", 10.0)
    assert state.trialled == frozenset() and dataclasses.replace(state, frozen=True).frozen
    est = MoveEstimate("sglang", 1.0, 1.0, 2.0, 3.0, 0.0, 4.0, 0.5)
    assert est.savings_basis == "short window" and est.worth_it


def test_refused_where_one_store_cannot_build_the_record() -> None:
    @dataclass
    class Mutable:
        x: int

    @dataclass(frozen=True)
    class WithPostInit:
        x: int

        def __post_init__(self) -> None:
            pass

    @dataclass(frozen=True)
    class WithoutInitField:
        x: int
        y: int = field(default=0, init=False)

    @dataclass(frozen=True, slots=True)
    class Slotted:
        x: int

    for cls in (Mutable, WithPostInit, WithoutInitField, Slotted):
        with pytest.raises(TypeError):
            fast_init(cls)
