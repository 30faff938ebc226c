"""Policy versions: which stored policy is active, and applying or restoring one.

A version is applied atomically: an invalid policy, or one whose schedule cannot be
built (`prepare`), never replaces the active one. A stored active version that no
longer loads (stored by an older release with looser checks) leaves the controller
leading with no active policy until another is applied.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from gearshift.common.errors import NotFound
from gearshift.controller.decisions.gpu_price import price_warning
from gearshift.controller.decisions.store import DecisionStore
from gearshift.controller.ingest.fleet import FleetState
from gearshift.controller.moves.canary import Sla
from gearshift.controller.store.database import Store
from gearshift.controller.store.tables import SETTING_ACTIVE_POLICY_VERSION, PolicyVersionRow
from gearshift.policies.loader import Policy, PolicyError, load_policy
from gearshift.policies.priors import priors_for
from gearshift.policies.schema import ModelPriors
from gearshift.policies.semantics import selector_warnings

log = logging.getLogger(__name__)


class PolicyVersions:
    """The active policy and the stored versions.

    `prepare` builds what a policy implies (its schedule) before it is stored; it raises
    InvalidArgument when it cannot, and nothing is stored. `on_change` hears every policy
    that became active. `gpu_price_per_hour` is the fleet's USD per GPU-hour
    (`--gpu-price-per-hour`), for the warning on policies that price nothing."""

    def __init__(self, store: Store, decisions: DecisionStore, fleet: FleetState, *,
                 gpu_price_per_hour: float | None = None,
                 prepare: Callable[[Policy], object] | None = None,
                 on_change: Callable[[Policy], None] | None = None) -> None:
        self.store = store  # settings: which version is active
        self.decisions = decisions
        self.fleet = fleet
        self.gpu_price_per_hour = gpu_price_per_hour
        self._prepare = prepare
        self._on_change = on_change
        self._policy: tuple[int, Policy] | None = None
        self._unloadable: int | None = None  # stored active version that no longer loads

    def active(self) -> tuple[int, Policy] | None:
        version = self.store.get_setting(SETTING_ACTIVE_POLICY_VERSION, None)
        if version is None:
            return None
        if self._policy is not None and self._policy[0] == version:
            return self._policy
        if self._unloadable == version:
            return None
        row = self.decisions.get_policy_version(version)
        if row is None:
            log.error("active policy version %s is missing from the store", version)
            return None
        try:
            self._policy = (version, load_policy(row.yaml_text, f"policy version {version}"))
        except PolicyError as exc:
            # Stored by an older release with looser checks: the controller still leads
            # and serves every command, with no active policy until one is applied.
            log.error("active policy version %s cannot be used; apply another: %s",
                      version, exc.message)
            self._unloadable = version
            return None
        return self._policy

    def validate(self, yaml_text: str, source: str, strict: bool = False) -> Policy:
        policy = load_policy(yaml_text, source or "<policy>", strict=strict)
        return self._with_fleet_warnings(policy, strict)

    def _with_fleet_warnings(self, policy: Policy, strict: bool) -> Policy:
        known = {m.model for m in self.fleet.models()}
        extra = selector_warnings(policy.doc, known, policy.source)
        if unpriced := price_warning(policy, self.gpu_price_per_hour, self.fleet):
            extra.append(unpriced)
        if extra and strict:
            raise PolicyError(extra)
        return replace(policy, warnings=(*policy.warnings, *extra)) if extra else policy

    def apply(self, yaml_text: str, source: str, applied_by: str, comment: str,
              strict: bool = False) -> tuple[PolicyVersionRow, bool, Policy]:
        policy = self.validate(yaml_text, source, strict)  # raises: nothing changes
        current = self.active()
        if current is not None:
            row = self.decisions.get_policy_version(current[0])
            if row is not None and row.yaml_text == yaml_text:
                return row, False, policy
        if self._prepare is not None:
            self._prepare(policy)  # raises: nothing stored
        version = self.decisions.add_active_policy_version(policy.name, yaml_text, applied_by,
                                                       comment)
        self._policy = (version, policy)
        log.info("policy %s applied as version %d (mode %s) by %s", policy.name, version,
                 policy.mode, applied_by or "?")
        if self._on_change is not None:
            self._on_change(policy)
        row = self.decisions.get_policy_version(version)
        assert row is not None
        return row, True, policy

    def restore(self, version: int) -> tuple[PolicyVersionRow, bool]:
        row = self.decisions.get_policy_version(version)
        if row is None:
            raise NotFound(f"policy version {version} does not exist")
        policy = load_policy(row.yaml_text, f"policy version {version}")
        current = self.active()
        if current is not None and current[0] == version:
            return row, False
        if self._prepare is not None:
            self._prepare(policy)
        self.store.set_setting(SETTING_ACTIVE_POLICY_VERSION, version)
        self._policy = (version, policy)
        if self._on_change is not None:
            self._on_change(policy)
        return row, True

    def priors(self, model: str) -> ModelPriors:
        current = self.active()
        return priors_for(current[1].doc.spec.models, model) if current is not None else ModelPriors()

    def sla_for(self, model: str) -> Sla:
        p = self.priors(model)
        return Sla(ttft_p99_s=p.sla_ttft_p99_ms / 1000 if p.sla_ttft_p99_ms else None,
                   itl_p99_s=p.sla_itl_p99_ms / 1000 if p.sla_itl_p99_ms else None)
