"""gearshift gateway: a stateless OpenAI-compatible router in front of every model's deployments.

The API port is a drop-in for clients written for vLLM: `POST /v1/completions` and
`/v1/chat/completions` (routed by `model`), `GET /v1/models`, `GET /v1/models/{id}` (ids
with slashes, as sent or percent-encoded) and `GET /health` (200 with a routing table, else
503). Every error answer, the gateway's own or an engine's, keeps its HTTP status and has
OpenAI's one shape, `{"error": {"message", "type", "param", "code"}}`, its `type` from the
status: 401 `authentication_error`, 403 `permission_error`, 404 `not_found_error`, 429
`rate_limit_error`, other 4xx `invalid_request_error`, 5xx `server_error`; an engine's message
and param are kept (`errors`). A stream already under way is relayed as it is.

Modules: `routes` (routing table, weighted choice, static routes files), `proxy`
(the router: forwarding, streaming, retries before the first byte), `pages` (the small GET
pages), `errors` (the error shape), `listener`
(client-facing HTTP/1.1 server), `connection` (one client connection, its limits
and deadlines), `request` (one request and its answer), `limits`
(client limits and the shared body budget), `request_checks` (hop-by-hop filter,
JSON depth, cut echoes), `upstream` and `upstream_pool` (kept-alive connections to the engines),
`http11` (strict HTTP/1.1 parsing and framing),
`controller_link` (WatchRoutes with backoff, ReportGateway), `metrics`
(Prometheus), `server` (`Gateway`, `GatewayConfig`, `serve`), `cli` (`gearshift gateway`).
"""
