"""What hosts and gateways report, as the controller holds it: the agents' stream service,
the in-memory fleet state, per-minute rollups, the request-rate series, gateway reports and
engine restarts."""
