"""From signals to stored decisions: the live policy loop around the pure core
(`gearshift.policies`), the facts it builds per model, policy versions, review (approve,
reject) and superseding, reconciling decisions from migration rows, the capacity learner and
forecaster, and the decisions' tables."""
