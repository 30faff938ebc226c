"""gearshift gateway: a stateless OpenAI-compatible router in front of every model's deployments.

Modules: `routes` (routing table, weighted choice, static routes files), `proxy`
(the aiohttp router: forwarding, streaming, retries before the first byte),
`controller_link` (WatchRoutes with backoff, ReportGateway), `metrics`
(Prometheus), `server` (`Gateway`, `GatewayConfig`, `serve`), `cli` (`gearshift gateway`).
"""
