"""The emulated engine's HTTP surface (aiohttp): OpenAI API, health, metrics, fault switches.

Paths and status codes are the real engines' (docs/engines.md): `/v1/models`,
`/v1/completions`, `/v1/chat/completions` (JSON or SSE) and `/version` for every
engine; the health paths of the engine's catalog entry; the metric paths (and
any other engine-specific path) of its emulator flavour (`flavor_*.py`), e.g.
vLLM's Prometheus `/metrics`, trtllm-serve's JSON `/metrics` and
`/prometheus/metrics`. `/emulator/faults` and `/emulator/state` exist only here,
for tests and the demo.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from aiohttp import web

from gearshift.agents.emulator.args import EngineArgs
from gearshift.agents.emulator.batching import BatchEngine
from gearshift.agents.emulator.config import EmulatorOptions, FaultError, Faults, apply_faults
from gearshift.agents.emulator.flavors import get_flavor
from gearshift.agents.emulator.iterstats import IterationStats
from gearshift.agents.emulator.metrics import EngineMetrics, RequestRecord
from gearshift.common.engines import engine_entry

WORDS = ("the", "model", "emulated", "engine", "returns", "plain", "tokens", "for", "tests",
         "and", "demos", "of", "gearshift")
MAX_TOKENS_LIMIT = 1_000_000


@dataclass
class EmulatorState:
    """Everything the handlers share; one per emulator process."""

    args: EngineArgs
    options: EmulatorOptions
    engine: BatchEngine
    metrics: EngineMetrics
    iterstats: IterationStats | None
    on_crash: Callable[[], None]
    faults: Faults = field(default_factory=Faults)
    draining: bool = False
    started_at: float = field(default_factory=time.time)
    requests_total: int = 0
    requests_rejected: int = 0
    inflight: set[asyncio.Task[Any]] = field(default_factory=set)
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def set_faults(self, faults: Faults) -> None:
        self.faults = faults
        self.engine.latency_factor = faults.latency_factor


STATE_KEY = web.AppKey("gearshift_emulator_state", EmulatorState)


class RequestError(Exception):
    """An OpenAI-style error answer."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.status}}
        return web.json_response(body, status=self.status)


def _bad(message: str, param: str | None = None) -> RequestError:
    return RequestError(400, message, "BadRequestError", param)


def _tokens(value: object, where: str) -> list[str]:
    """Whitespace words stand in for tokens (token ids are their own tokens)."""
    if isinstance(value, str):
        return value.split()
    if isinstance(value, list):
        if all(isinstance(x, int) for x in value):
            return [str(x) for x in value]
        return [token for x in value for token in _tokens(x, where)]
    if isinstance(value, dict) and isinstance(value.get("text"), str):
        return _tokens(value["text"], where)
    raise _bad(f"{where}: expected text, a list of texts or token ids, got {type(value).__name__}",
               where)


@dataclass(frozen=True)
class Generation:
    """A parsed completion or chat request."""

    chat: bool
    stream: bool
    include_usage: bool
    prompt: tuple[str, ...]  # the prompt's tokens, for the prefix cache
    max_tokens: int
    finish_reason: str

    @property
    def prompt_tokens(self) -> int:
        return max(1, len(self.prompt))


async def _parse(request: web.Request, state: EmulatorState, *, chat: bool) -> Generation:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _bad(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise _bad(f"request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model", state.args.served_model_name)
    if model != state.args.served_model_name:
        raise RequestError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("'messages' must be a non-empty list", "messages")
        prompt: list[str] = []
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict) or "role" not in msg:
                raise _bad(f"messages[{i}] must be an object with a 'role'", "messages")
            prompt += _tokens(msg.get("content") or "", f"messages[{i}].content")
    else:
        if "prompt" not in body:
            raise _bad("'prompt' is required", "prompt")
        prompt = _tokens(body["prompt"], "prompt")
    limit = body.get("max_completion_tokens") if chat else None
    if limit is None:
        limit = body.get("max_tokens")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                              or not 1 <= limit <= MAX_TOKENS_LIMIT):
        raise _bad(f"'max_tokens' must be an integer in 1..{MAX_TOKENS_LIMIT}, got {limit!r}",
                   "max_tokens")
    if body.get("n", 1) != 1:
        raise _bad("the emulator supports only n=1", "n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad(f"'stream' must be true or false, got {stream!r}", "stream")
    opts = body.get("stream_options") or {}
    include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
    # With max_tokens the emulated model runs to the limit ("length"); without it
    # it stops by itself after the configured number of tokens ("stop").
    tokens = limit if limit is not None else state.options.output_tokens
    return Generation(chat=chat, stream=stream, include_usage=include_usage,
                      prompt=tuple(prompt), max_tokens=tokens,
                      finish_reason="length" if limit is not None else "stop")


async def _generate(state: EmulatorState, gen: Generation,
                    emit: Callable[[int, str], Awaitable[None]]) -> RequestRecord:
    """Run one request through the batching model, emitting each token."""
    loop = asyncio.get_running_loop()
    engine = state.engine
    record = RequestRecord(prompt_tokens=gen.prompt_tokens, max_tokens=gen.max_tokens)
    start = loop.time()
    finished = "abort"
    try:
        async with engine.slot(gen.prompt_tokens) as hold:
            record.queue_s = loop.time() - start
            if state.iterstats is not None:
                state.iterstats.note_admitted(record.queue_s)
            # Cached prompt blocks skip prefill. Sleep to scheduled times, not for
            # durations, so timer overshoot does not accumulate over the tokens.
            record.cached_tokens = engine.prefix_cache.lookup(gen.prompt)
            due = loop.time() + engine.prefill_s(gen.prompt_tokens - record.cached_tokens)
            await asyncio.sleep(due - loop.time())
            last = loop.time()
            record.ttft_s = last - start
            for i in range(gen.max_tokens):
                if i:
                    due += engine.itl_s()
                    await asyncio.sleep(max(0.0, due - loop.time()))
                    now = loop.time()
                    record.itls_s.append(now - last)
                    state.metrics.observe_token(now - last)
                    last = now
                hold.add(1)
                record.generation_tokens += 1
                await emit(i, " " + WORDS[i % len(WORDS)])
        finished = gen.finish_reason
    finally:
        record.e2e_s = loop.time() - start
        record.finished_reason = finished
        state.metrics.observe_request(record)
        if state.iterstats is not None:
            state.iterstats.note_completed()
    return record


def _usage(record: RequestRecord) -> dict[str, int]:
    return {"prompt_tokens": record.prompt_tokens,
            "total_tokens": record.prompt_tokens + record.generation_tokens,
            "completion_tokens": record.generation_tokens}


def _choice(gen: Generation, text: str | None, finish: str | None, *, first: bool) -> dict[str, Any]:
    if not gen.chat:
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish,
                "stop_reason": None}
    delta: dict[str, Any] = {"role": "assistant", "content": text or ""} if first \
        else {"content": text or ""}
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}


async def _serve_generation(request: web.Request, *, chat: bool) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    if state.draining:
        state.requests_rejected += 1
        return RequestError(503, "The server is shutting down.", "ServiceUnavailableError").response()
    if state.engine.sleep_level:
        state.requests_rejected += 1
        return RequestError(503, "The model is sleeping; POST /wake_up first.",
                            "ServiceUnavailableError").response()
    try:
        gen = await _parse(request, state, chat=chat)
    except RequestError as err:
        state.requests_rejected += 1
        return err.response()
    state.requests_total += 1
    task = asyncio.current_task()
    assert task is not None
    state.inflight.add(task)
    state.idle.clear()
    try:
        return await _respond(request, state, gen)
    finally:
        state.inflight.discard(task)
        if not state.inflight:
            state.idle.set()


async def _respond(request: web.Request, state: EmulatorState,
                   gen: Generation) -> web.StreamResponse:
    rid = ("chatcmpl-" if gen.chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    model = state.args.served_model_name
    obj = "chat.completion" if gen.chat else "text_completion"
    if not gen.stream:
        parts: list[str] = []

        async def collect(_i: int, text: str) -> None:
            parts.append(text)

        record = await _generate(state, gen, collect)
        text = "".join(parts)
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
             "finish_reason": record.finished_reason} if gen.chat else
            {"index": 0, "text": text, "logprobs": None, "finish_reason": record.finished_reason,
             "stop_reason": None})
        return web.json_response({"id": rid, "object": obj, "created": created, "model": model,
                                  "choices": [choice], "usage": _usage(record)})

    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    chunk_obj = "chat.completion.chunk" if gen.chat else "text_completion"

    async def send(payload: dict[str, Any]) -> None:
        await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

    async def emit(i: int, text: str) -> None:
        finish = gen.finish_reason if i == gen.max_tokens - 1 else None
        await send({"id": rid, "object": chunk_obj, "created": created, "model": model,
                    "choices": [_choice(gen, text, finish, first=i == 0)]})

    record = await _generate(state, gen, emit)
    if gen.include_usage:
        await send({"id": rid, "object": chunk_obj, "created": created, "model": model,
                    "choices": [], "usage": _usage(record)})
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve_generation(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve_generation(request, chat=True)


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    owner = get_flavor(state.args.flavor).owned_by
    return web.json_response({"object": "list", "data": [{
        "id": state.args.served_model_name, "object": "model", "created": int(state.started_at),
        "owned_by": owner, "root": state.args.model, "parent": None}]})


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    return web.Response(status=200 if state.faults.health_ok else 503)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": request.app[STATE_KEY].options.engine_version})


PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


async def prometheus_metrics(request: web.Request) -> web.Response:
    """The metrics container rendered as Prometheus text."""
    body = request.app[STATE_KEY].metrics.render()
    return web.Response(body=body, headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})


async def post_faults(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    try:
        spec = await request.json()
        faults, crash = apply_faults(state.faults, spec, where="POST /emulator/faults")
    except json.JSONDecodeError as exc:
        return _bad(f"POST /emulator/faults: body is not valid JSON: {exc}").response()
    except FaultError as exc:
        return _bad(str(exc)).response()
    state.set_faults(faults)
    print(f"emulator: faults now {faults.to_json()}" + (" (crashing)" if crash else ""),
          file=sys.stderr, flush=True)
    resp = web.json_response({"faults": faults.to_json(), "crash": crash})
    if crash:
        await resp.prepare(request)
        await resp.write_eof()
        state.on_crash()
    return resp


async def get_state(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    args = asdict(state.args)
    args["ignored"] = list(state.args.ignored)
    options = asdict(state.options)
    options.pop("faults")
    options.pop("release_facts")
    facts = state.options.release_facts  # the emulated release's extracted facts, if any
    options["release"] = None if facts is None else {
        "version": facts.version, "origin": facts.origin, "derived": facts.derived}
    return web.json_response({
        "flavor": state.args.flavor, "args": args, "options": options,
        "faults": state.faults.to_json(), "max_batch": state.engine.max_batch,
        "running": state.engine.running, "waiting": state.engine.waiting,
        "kv_cache_usage": state.engine.kv_usage, "inflight": len(state.inflight),
        "sleep_level": state.engine.sleep_level,
        "requests_total": state.requests_total, "requests_rejected": state.requests_rejected,
        "draining": state.draining})


def build_app(state: EmulatorState) -> web.Application:
    """The aiohttp application for one emulated engine."""
    app = web.Application()
    app[STATE_KEY] = state
    state.idle.set()
    routes = [
        web.get("/v1/models", models),
        web.post("/v1/completions", completions),
        web.post("/v1/chat/completions", chat_completions),
        web.get("/version", version),
        web.post("/emulator/faults", post_faults),
        web.get("/emulator/state", get_state),
    ]
    routes += [web.get(path, health) for path in engine_entry(state.args.flavor).health.paths]
    routes += get_flavor(state.args.flavor).routes()
    app.add_routes(routes)
    return app
