"""The routes: each parses its body, builds a job, and hands it to the service. Nothing here
touches the model; ``create_app`` wires the worker, the gate and the error format together."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator, Callable
from functools import partial
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response

from localspec import __version__
from localspec.engine.api import ServedEngine
from localspec.engine.types import EngineSettings, ModelSettings
from localspec.server import chat, prompts, slot_actions
from localspec.server import stats_page as stats_view
from localspec.server.chatmodel import reading_chat_model
from localspec.server.dispatch import error_response
from localspec.server.errors import ApiError, InvalidRequest, NotSupported
from localspec.server.gate import Direct, Gate, LeanRoute, body_models, route_paths
from localspec.server.metrics import CONTENT_TYPE
from localspec.server.options import ServerSettings
from localspec.server.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    InfillRequest,
    OpenAICompletionRequest,
    TokenizeRequest,
    validation_message,
)
from localspec.server.results import CompactJSONResponse
from localspec.server.state import Service
from localspec.server.upstream.backend import Upstream
from localspec.server.upstream.config import UpstreamSettings
from localspec.server.upstream.failover import Failover, local_probe, ready_probe
from localspec.server.upstream.openai_kind import Limits
from localspec.server.worker import EngineThread

log = logging.getLogger("localspec.server")


async def service(request: Request) -> Service:
    """The routes' one dependency, declared with ``Depends`` (``Svc``) and solved by
    ``gate.LeanRoute`` per request (async: FastAPI runs a plain ``def`` one in a thread)."""
    return request.app.state.service


Svc = Annotated[Service, Depends(service)]


router = APIRouter(route_class=LeanRoute)


WEB_UI = Path(__file__).with_name("webui.html")


@router.get("/", include_in_schema=False)
@router.get("/index.html", include_in_schema=False)
async def web_ui() -> Response:
    """A chat page where llama-server serves its web UI: llama-vscode's "Chat with AI" panel
    opens the chat endpoint's "/" in an iframe and sends it the question (webui.html)."""
    return Response(WEB_UI.read_bytes(), media_type="text/html; charset=utf-8")


@router.get("/stats", include_in_schema=False)
async def stats_page() -> Response:
    """A live page of latency, acceptance by language and position, cache reuse and load,
    served as the chat page is (one file; it polls /stats/data)."""
    return Response(stats_view.PAGE.read_bytes(), media_type="text/html; charset=utf-8")


@router.get("/stats/data")
async def stats_data(request: Request, svc: Svc) -> Response:
    """What /stats draws; ``?since=T``: only the requests that ended after T (epoch seconds)."""
    try:
        since = float(request.query_params.get("since") or 0.0)
    except ValueError:
        return error_response(InvalidRequest("since must be a number (epoch seconds)"), request)
    engine = svc.worker.engine
    governor = None if engine is None else engine.governor
    threads = None if governor is None else (governor.free, governor.other_busy)
    return CompactJSONResponse(stats_view.data(svc.spec, threads, since=since))


@router.get("/health")
# (a route of its own: one route for GET and HEAD gives both operations one id)
@router.api_route("/health", methods=["HEAD"], operation_id="health_head")
@router.api_route("/v1/health", methods=["GET", "HEAD"], include_in_schema=False)
async def health() -> Response:
    """Also for HEAD: uptime monitors and load balancers probe with it."""
    return CompactJSONResponse({"status": "ok"})


@router.post("/infill")
async def infill(body: InfillRequest, request: Request, svc: Svc) -> Response:
    """Fill in the middle, as llama-vscode and llama.vim call it."""
    try:
        prompts.fim_tokens(svc.engine.vocab)  # 501 before queueing, as llama-server
        params = svc.params(body)
    except ApiError as exc:
        return error_response(exc, request)
    svc.spec.begin(request, body)
    fim = partial(
        prompts.infill,
        input_prefix=body.input_prefix,
        input_suffix=body.input_suffix,
        prompt=body.prompt or "",
        spm=svc.settings.spm_infill,
        room=svc.settings.infill_room,
        infill_layout=svc.settings.infill_layout,
        ring_attention=svc.settings.ring_attention,
        cache=svc.token_cache,
    )
    prepare = fim(
        input_extra=body.input_extra or (),
        window=svc.settings.infill_window,
        # (llama-server's layout has no ring warm-up of its own: the whole prompt is filled)
        ring_only=svc.settings.infill_layout == "typed-in-middle" and body.is_ring_warmup,
    )
    job = svc.job(params, prepare)
    # a budget answer's prompt (server/jump.py): the cursor's nearest lines, no extra context
    job.short = lambda engine, window: fim(input_extra=(), window=window)(engine)
    return await svc.native(request, "infill", job)


@router.post("/completion")
@router.post("/completions", include_in_schema=False)
async def completion(body: CompletionRequest, request: Request, svc: Svc) -> Response:
    """llama-server's native completion API."""
    try:
        params = svc.params(body)
    except ApiError as exc:
        return error_response(exc, request)
    svc.spec.begin(request, body)
    prepare = prompts.completion(body.prompt, cache=svc.token_cache)
    return await svc.native(request, "completion", svc.job(params, prepare, truncate=True))


@router.post("/v1/completions")
async def openai_completions(body: OpenAICompletionRequest, request: Request, svc: Svc) -> Response:
    """OpenAI completions; a ``suffix`` makes it fill-in-the-middle (no extra context)."""
    truncate = body.suffix is None  # a FIM layout is made to fit; a plain prompt is cut
    try:
        params = svc.params(body)
        if body.suffix is not None:
            prompts.fim_tokens(svc.engine.vocab)
            if not isinstance(body.prompt, str):
                raise InvalidRequest("with a suffix, the prompt must be a string")
            prepare = prompts.infill(
                input_prefix=body.prompt,
                input_suffix=body.suffix,
                input_extra=[],
                prompt="",
                spm=svc.settings.spm_infill,
                room=svc.settings.infill_room,
                window=svc.settings.infill_window,
                cache=svc.token_cache,
            )
        else:
            prepare = prompts.completion(body.prompt, cache=svc.token_cache)
    except ApiError as exc:
        return error_response(exc, request)
    svc.spec.begin(request, body)
    return await svc.openai(request, svc.job(params, prepare, truncate=truncate))


@router.post("/v1/chat/completions")
@router.post("/chat/completions", include_in_schema=False)
async def chat_completions(body: ChatCompletionRequest, request: Request, svc: Svc) -> Response:
    """OpenAI chat: the messages rendered with the model's own chat template, streamed or not,
    tool calls in the model's format answered as ``tool_calls`` (llama.vim's instruction
    editing, llama-vscode's chat, edit and agent)."""
    return await chat.chat_completions(body, request, svc)


@router.post("/apply-template")
async def apply_template(body: ChatCompletionRequest, request: Request, svc: Svc) -> Response:
    """The prompt a chat request would run, as ``{"prompt": text}``."""
    return await chat.apply_template(body, request, svc)


@router.get("/props")
async def props(request: Request, svc: Svc) -> Response:
    """The server's properties; ``?model=NAME`` those of that served model."""
    return CompactJSONResponse(svc.for_model(request.query_params.get("model")).props())


@router.get("/v1/models")
@router.get("/models", include_in_schema=False)
async def models(svc: Svc) -> Response:
    return CompactJSONResponse(svc.models())


@router.get("/slots")
async def slots(svc: Svc) -> Response:
    return CompactJSONResponse(svc.slots())


@router.get("/metrics")
async def metrics(svc: Svc) -> Response:
    if svc.metrics is None:
        return error_response(
            NotSupported("This server does not support metrics endpoint; enable metrics")
        )
    return Response(svc.metrics.render(), media_type=CONTENT_TYPE)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request, svc: Svc) -> Response:
    def run(engine: ServedEngine) -> dict[str, Any]:
        vocab = engine.vocab
        pieces = [body.content] if isinstance(body.content, str) else body.content
        # ids given by the client reach llama.cpp's token_to_piece, which aborts the whole
        # process on an id outside the vocabulary (found by the schema fuzzer): check first
        prompts.check_ids([p for p in pieces if not isinstance(p, str)], vocab.n_vocab)
        tokens: list[int] = []
        for piece in pieces:
            if isinstance(piece, str):
                tokens.extend(vocab.tokenize(piece, special=body.parse_special))
            else:
                tokens.append(piece)
        if body.add_special and vocab.add_bos and vocab.bos is not None:
            tokens.insert(0, vocab.bos)
        if not body.with_pieces:
            return {"tokens": tokens}
        return {
            "tokens": [{"id": t, "piece": _piece(vocab.piece(t, special=True))} for t in tokens]
        }

    try:
        worker = svc.for_model(body.model).worker
        return CompactJSONResponse(await asyncio.wrap_future(worker.call(run)))
    except Exception as exc:
        return error_response(exc, request)


def _piece(raw: bytes) -> str | list[int]:
    """A token's text as llama-server shows it: a string, or its bytes where they are not whole
    UTF-8 (a character split over several tokens)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request, svc: Svc) -> Response:
    def run(engine: ServedEngine) -> dict[str, Any]:
        prompts.check_ids(body.tokens, engine.vocab.n_vocab)
        return {"content": engine.vocab.detokenize(body.tokens, special=True)}

    try:
        worker = svc.for_model(body.model).worker
        return CompactJSONResponse(await asyncio.wrap_future(worker.call(run)))
    except Exception as exc:
        return error_response(exc, request)


# ---------------------------------------------------------------------- errors


async def _on_validation_error(request: Request, exc: Exception) -> Response:
    # only for a route left to FastAPI's own handler (LeanRoute parses its bodies itself)
    assert isinstance(exc, RequestValidationError)
    return error_response(InvalidRequest(validation_message(exc.errors(), skip=1)), request)


async def _on_http_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        body = {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}}
    else:
        body = {
            "error": {
                "code": exc.status_code,
                "message": str(exc.detail),
                "type": "invalid_request_error",
            }
        }
    return CompactJSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def _on_error(request: Request, exc: Exception) -> Response:
    return error_response(exc, request)


# ---------------------------------------------------------------------- factory


def default_loader(engine_settings: EngineSettings) -> Callable[[], ServedEngine]:
    def load() -> ServedEngine:
        from localspec.engine import Engine  # imported here: llama.cpp loads only when serving

        return Engine.load(engine_settings)

    return load


def _once(callback: Callable[[], None] | None) -> Callable[[], None] | None:
    """``callback`` called at most once (the upstream and the local model both make the
    daemon ready; whichever comes first says so)."""
    if callback is None:
        return None
    done = False

    def call() -> None:
        nonlocal done
        if not done:
            done = True
            callback()

    return call


def _when_all_ready(on_ready: Callable[[], None] | None, n: int) -> Callable[[], None] | None:
    """``on_ready`` once all ``n`` workers have loaded their models (each calls this once)."""
    if on_ready is None or n == 1:
        return on_ready
    lock, left = threading.Lock(), [n]

    def one_ready() -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            on_ready()

    return one_ready


def _chat_failed(ready: Callable[[], None] | None) -> Callable[[BaseException], None]:
    """A chat pair that fails to load leaves completion serving: chat answers a 501 with the
    reason, and the daemon counts as ready once the completion pair is."""

    def failed(exc: BaseException) -> None:
        log.error("the chat model failed to load; chat is unavailable: %s", exc)
        if ready is not None:
            ready()

    return failed


def create_app(
    server_settings: ServerSettings,
    engine_settings: EngineSettings | None,
    *,
    load: Callable[[], ServedEngine] | None = None,
    on_ready: Callable[[], None] | None = None,
    on_failure: Callable[[BaseException], None] | None = None,
    upstream: UpstreamSettings | None = None,
    chat_engine_settings: EngineSettings | None = None,
    chat_load: Callable[[], ServedEngine] | None = None,
) -> FastAPI:
    """The ASGI app; the engine loads in a background thread at startup (/health: 503 till then).

    ``engine_settings.n_slots`` is the slot count (llama-server's ``-np``). With ``upstream``
    the editor's requests go to a team server (server/upstream/), the local model
    (``engine_settings``; None: no local model) answering while it is down or slow.
    ``chat_engine_settings``: a second pair, with a worker of its own, that answers chat
    (``server_settings.chat_alias`` names it).
    """

    has_local = engine_settings is not None
    if engine_settings is None:
        if upstream is None:
            raise ValueError("nothing to serve: give engine_settings, an upstream, or both")
        # never loaded: the worker does not start without a local model
        engine_settings = EngineSettings(target=ModelSettings(path=""))
    on_ready = _once(on_ready)
    ready = _when_all_ready(on_ready, 1 if chat_engine_settings is None else 2)
    engine_thread = EngineThread()  # both pairs' llama.cpp calls, one after the other
    svc = Service.create(
        server_settings,
        engine_settings,
        reading_chat_model(load or default_loader(engine_settings)),
        on_ready=ready,
        on_failure=on_failure,
        engine_thread=engine_thread,
    )
    remote = None
    if upstream is not None:
        remote = Upstream(
            upstream,
            limits=Limits(
                n_cmpl_max=server_settings.n_cmpl_max,
                spm_infill=server_settings.spm_infill,
                infill_room=server_settings.infill_room,
                infill_window=server_settings.infill_window,
            ),
            registry=svc.metrics.registry if svc.metrics is not None else None,
        )
    if chat_engine_settings is not None:
        chat_settings = dataclasses.replace(
            server_settings,
            chat_refusal=None,
            model_alias=server_settings.chat_alias or Path(chat_engine_settings.target.path).name,
        )
        svc.chat_service = Service.create(
            chat_settings,
            chat_engine_settings,
            reading_chat_model(chat_load or default_loader(chat_engine_settings)),
            on_ready=ready,
            on_failure=_chat_failed(ready),
            engine_thread=engine_thread,
        )
        svc.chat_service.metrics = svc.metrics  # one registry: requests of both models
        svc.chat_service.spec = svc.spec
    workers = ([svc.worker] if has_local else []) + (
        [svc.chat_service.worker] if svc.chat_service else []
    )

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        for worker in workers:
            worker.start()
        if remote is not None:
            await remote.start()
            if remote.health.usable and on_ready is not None:
                on_ready()
        try:
            yield
        finally:
            if remote is not None:
                await remote.aclose()
            for worker in workers:
                await run_in_threadpool(worker.stop)

    app = FastAPI(
        title="localspec",
        version=__version__,
        description="llama-server compatible completion API (llama-vscode, llama.vim).",
        default_response_class=CompactJSONResponse,
        lifespan=lifespan,
        # FastAPI's OpenTelemetry hooks: off (the daemon has its own metrics and request log);
        # on, every request first asks OpenTelemetry whether a provider is configured
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.state.service = svc
    app.include_router(router)
    app.include_router(slot_actions.router)  # POST /slots/{id}: a path parameter, FastAPI's way
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_error)
    metrics = svc.metrics
    app.add_middleware(Direct, routes=app.routes)  # added first: innermost, inside the gate
    not_ready = svc.not_ready
    if remote is not None:
        local = local_probe(svc.not_ready, has_local)
        app.add_middleware(
            Failover,
            upstream=remote,
            local=local,
            local_props=svc.props,
            local_model=svc.model_name if has_local else None,
            bodies=body_models(app.routes),
        )
        not_ready = ready_probe(remote, local)
        remote.local_model = svc.model_name if has_local else None
        remote.local_state = local
    app.state.upstream = remote
    app.add_middleware(
        Gate,
        api_key=server_settings.api_key,
        not_ready=not_ready,
        max_body=server_settings.max_body_bytes,
        body_timeout_s=server_settings.body_timeout_s,
        routes=route_paths(app.routes),
        observer=None
        if metrics is None
        else lambda e: metrics.observe_http(e.route, e.status, e.total_ms / 1e3),
    )
    if server_settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(server_settings.cors_origins),
            allow_methods=["*"],
            allow_headers=["*"],
        )
    return app
