"""Hypothesis settings for the fuzz properties: lean under `make test`, long under
`make fuzz` (GEARSHIFT_FUZZ_EXAMPLES sets the examples per property)."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "gearshift-fuzz",
    max_examples=int(os.environ.get("GEARSHIFT_FUZZ_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                           HealthCheck.function_scoped_fixture],
    derandomize=os.environ.get("GEARSHIFT_FUZZ_EXAMPLES") is None,  # make test: repeatable
)
FUZZ = settings.get_profile("gearshift-fuzz")  # @FUZZ on each property
