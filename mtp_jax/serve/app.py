"""The HTTP app: `POST /v1/completions`, `POST /v1/chat/completions` (streamed as server-sent events or whole),
`GET /v1/models`, `GET /health`, `GET /metrics`, in front of one `Worker` whose engine slots every client shares.

Anything the client sent wrong gets a 4xx status and an OpenAI-style error body (never a 500 or a traceback):
malformed JSON, an unknown field or a wrong type (400), a prompt and max_tokens past a slot's positions (400), an
unknown model name (404 `model_not_found`), an unknown route (404), a body past the size limit (413), a missing or
wrong API key (401). A client that goes away has its request cancelled (its slot freed at the engine's next step).
While the server shuts down (SIGTERM), new requests get 503 and running ones finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import sys
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from mtp_jax.serve.guards import Guards
from mtp_jax.serve.inputs import Limits, budget, chat_ids, completion_ids
from mtp_jax.serve.metrics import EngineSnapshot, Metrics
from mtp_jax.serve.protocol import (
    COMPLETION_MAX_TOKENS,
    ApiError,
    ChatRequest,
    CompletionRequest,
    Settings,
    error_body,
    parse,
    settings,
)
from mtp_jax.serve.responses import DONE, Shape, sse
from mtp_jax.serve.worker import Event, Job, Worker

MAX_BODY_BYTES = 1 << 20
METRICS_TIMEOUT = 10.0  # seconds /metrics waits for the worker's snapshot before showing the last one
CLIENT_GONE = 499  # nginx's status for a request whose client closed the connection first


@dataclasses.dataclass
class Served:
    """What the app serves: the worker and its engine's limits, the tokenizer, the model's name, the metrics."""

    worker: Worker
    tokenizer: object
    model_name: str
    limits: Limits
    metrics: Metrics
    draining: bool = False  # set at SIGTERM: new requests are refused
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    last_snapshot: EngineSnapshot = dataclasses.field(default_factory=EngineSnapshot)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(404, f"the model {name!r} does not exist: this server serves {self.model_name!r}",
                           param="model", code="model_not_found")  # fmt: skip

    def check_available(self) -> None:
        if not self.worker.alive:
            raise ApiError(503, self.worker.failure or "the engine is not running")
        if self.draining:
            raise ApiError(503, "the server is shutting down")


def create_app(served: Served, *, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> Guards:
    """The ASGI app serving `served` (the worker already started; closed when the app shuts down)."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        served.worker.close()

    app = FastAPI(title="mtp_jax", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    add_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = parse(CompletionRequest, await request.body())
        served.check_model(body.model)
        given = settings(body)
        ids = await run_in_threadpool(completion_ids, served.tokenizer, body.prompt, served.limits)
        max_tokens = budget(ids, COMPLETION_MAX_TOKENS if given.max_tokens is None else given.max_tokens,
                            served.limits)  # fmt: skip
        return await generate(served, request, ids, max_tokens, given, Shape(served.model_name, chat=False))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = parse(ChatRequest, await request.body())
        served.check_model(body.model)
        given = settings(body)
        messages = [message_dict(m) for m in body.messages]
        ids = await run_in_threadpool(chat_ids, served.tokenizer, messages, served.limits)
        max_tokens = budget(ids, given.max_tokens, served.limits)
        return await generate(served, request, ids, max_tokens, given, Shape(served.model_name, chat=True))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(served)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        served.check_model(name)
        return model_card(served)

    @app.get("/health")
    async def health():
        served.check_available()
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        try:
            future = asyncio.wrap_future(served.worker.snapshot())
            served.last_snapshot = await asyncio.wait_for(future, METRICS_TIMEOUT)
        except (asyncio.TimeoutError, RuntimeError):
            pass  # a busy or stopped worker: the last snapshot
        text = served.metrics.render(served.last_snapshot)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    return Guards(app, api_key=api_key, max_body_bytes=max_body_bytes)


def message_dict(message) -> dict:
    """A chat message as the chat template reads it ("developer" is OpenAI's newer name for "system")."""
    role = "system" if message.role == "developer" else message.role
    return {"role": role, "content": message.content, **({"name": message.name} if message.name else {})}


def model_card(served: Served) -> dict:
    return {"id": served.model_name, "object": "model", "created": served.created, "owned_by": "mtp_jax",
            "max_model_len": served.limits.max_len}  # fmt: skip


async def generate(served: Served, request: Request, prompt_ids: tuple[int, ...], max_tokens: int,
                   given: Settings, shape: Shape) -> Response:  # fmt: skip
    """Decode one request through the worker: its events streamed, or its whole answer."""
    served.check_available()
    seed = secrets.randbits(32) if given.seed is None else given.seed
    job = Job(prompt_ids, max_tokens, given.temperature, given.top_p, given.top_k, seed, given.stop,
              asyncio.get_running_loop(), asyncio.Queue())  # fmt: skip
    served.worker.submit(job)
    if given.stream:
        shape.include_usage = given.include_usage
        events = stream(served.worker, job, shape, len(prompt_ids))
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    event = await last_event_unless_gone(served.worker, job, request)
    if event is None:
        return Response(status_code=CLIENT_GONE)
    return JSONResponse(shape.whole(event.answer, event.finish_reason, len(prompt_ids), event.completion_tokens))


async def stream(worker: Worker, job: Job, shape: Shape, prompt_tokens: int):
    """The job's server-sent events; the job is cancelled when the stream stops early (the client gone)."""
    try:
        if shape.chat:
            yield sse(shape.chunk(None))
        while True:
            event = await job.events.get()
            if event.error is not None:
                yield sse(event.error.body())
                break
            if event.text:
                yield sse(shape.chunk(event.text))
            if event.finish_reason is not None:
                yield sse(shape.chunk("", event.finish_reason))
                if shape.include_usage:
                    yield sse(shape.usage_chunk(prompt_tokens, event.completion_tokens))
                break
        yield DONE
    finally:
        if not job.over:
            worker.cancel(job)


async def last_event_unless_gone(worker: Worker, job: Job, request: Request) -> Event | None:
    """The job's last event, or None when the client disconnected first (the job is then cancelled)."""
    ending = asyncio.ensure_future(last_event(job))
    gone = asyncio.ensure_future(disconnected(request.receive))
    try:
        done, _ = await asyncio.wait({ending, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        ending.cancel()
        gone.cancel()
        if not job.over:
            worker.cancel(job)
    if ending not in done:
        return None
    event = ending.result()
    if event.error is not None:
        raise event.error
    return event


async def last_event(job: Job) -> Event:
    while True:
        event = await job.events.get()
        if event.error is not None or event.finish_reason is not None:
            return event


async def disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's error object: ours, Starlette's (unknown route, wrong method), and any other (500,
    its traceback on the server's stderr only)."""

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return JSONResponse(e.body(), e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        where = f"{request.method} {request.url.path}"
        message = {404: f"no such route: {where}", 405: f"method not allowed: {where}"}.get(e.status_code, e.detail)
        return JSONResponse(error_body(e.status_code, message), e.status_code, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e: RequestValidationError):
        return JSONResponse(error_body(400, f"invalid request: {e.errors()[:1]}"), 400)

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        print(f"mtp_jax.serve: {request.method} {request.url.path} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return JSONResponse(error_body(500, f"internal error ({type(e).__name__})"), 500)
