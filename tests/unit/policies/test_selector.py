"""A policy's selector names a model as `fnmatch.fnmatchcase` reads its globs (compiled
into one pattern for the fleet's models), or by name."""

from __future__ import annotations

import fnmatch
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from gearshift.policies.core import selects
from gearshift.policies.loader import load_policy

from .conftest import policy_text

GLOB = st.text(alphabet="ab-*?[]!.", max_size=6)
NAME = st.text(alphabet="ab-.[]!\n", max_size=6)


@settings(max_examples=60, deadline=None)
@given(globs=st.lists(GLOB, max_size=3), names=st.lists(NAME, max_size=2),
       models=st.lists(NAME, min_size=1, max_size=8))
def test_selects_as_fnmatchcase_and_names_do(globs: list[str], names: list[str],
                                             models: list[str]) -> None:
    selector = json.dumps({"globs": globs, "names": names})
    policy = load_policy(policy_text(f"  selector: {selector}\n"))
    for model in models + names:
        named = (not globs and not names) or model in names or any(
            fnmatch.fnmatchcase(model, g) for g in globs)
        assert selects(policy, model, {}) is named
