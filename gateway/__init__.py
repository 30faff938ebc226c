"""gearshift gateway: a stateless OpenAI-compatible router in front of every model's deployments.

Modules: `routes` (routing table, weighted choice, static routes files), `proxy`
(the router: forwarding, streaming, retries before the first byte), `listener`
(client-facing HTTP/1.1 server), `connection` (one client connection, its limits
and deadlines), `request` (one request and its answer), `limits`
(client limits and the shared body budget), `request_checks` (hop-by-hop filter,
JSON depth, cut echoes), `upstream` and `upstream_pool` (kept-alive connections to the engines),
`http11` (strict HTTP/1.1 parsing and framing),
`controller_link` (WatchRoutes with backoff, ReportGateway), `metrics`
(Prometheus), `server` (`Gateway`, `GatewayConfig`, `serve`), `cli` (`gearshift gateway`).
"""
