"""Development fleets: whole gearshift fleets on loopback for the demo, tests and benchmarks.

Nothing here runs in production. `local_fleet` starts a controller, agents with
emulated engines and a gateway as real child processes; `ha_fleet` several
controllers on one PostgreSQL; `local_pg` a private PostgreSQL server; `load`
the load generator; `scenario` the demo's scenario; `ports` and `waiting` the
helpers they share.
"""
