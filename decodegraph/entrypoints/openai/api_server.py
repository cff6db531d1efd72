"""`decodegraph serve MODEL`: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

Every error, including FastAPI's own validation errors, unknown routes, oversized bodies
and bad API keys, is answered with the OpenAI error body; bad input is a 4xx, never a 500.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import secrets
import sys
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from decodegraph.engine.async_llm import AsyncLLM
from decodegraph.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from decodegraph.entrypoints.openai.serving_chat import OpenAIServingChat, load_chat_template
from decodegraph.entrypoints.openai.serving_completion import OpenAIServingCompletion
from decodegraph.entrypoints.openai.serving_engine import (
    ClientDisconnected,
    OpenAIError,
    error_body,
    error_response,
)
from decodegraph.entrypoints.openai.serving_tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    OpenAIServingTokenization,
    TokenizeRequest,
    TokenizeResponse,
)
from decodegraph.entrypoints.openai.tool_parsers import TOOL_PARSERS
from decodegraph.metrics import PROMETHEUS_CONTENT_TYPE

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BODY_BYTES = 1 << 20
# The engine thread and the event loop share one GIL. At CPython's default switch
# interval (5 ms) a thread waiting for the GIL forces the holder off it that often, so
# a busy event loop keeps cutting into the engine's steps; a longer interval leaves the
# engine whole steps, and the loop still gets the GIL each time the engine releases it
# (in most torch ops and in every queue wait). Measured in docs/performance.md
# (2026-12-01, server throughput).
SERVER_SWITCH_INTERVAL_S = 0.02
# Whether `serve` runs the engine core in a process of its own (--engine-core-process);
# chosen by measurement, docs/performance.md (server throughput).
DEFAULT_ENGINE_CORE_PROCESS = False
try:
    VERSION = importlib.metadata.version("decodegraph")
except importlib.metadata.PackageNotFoundError:  # run from a source tree
    VERSION = "0.0.0+unknown"
_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 503)
}


class GuardMiddleware:
    """Pure ASGI middleware: API-key check on /v1 routes and a request body-size limit.

    The body is read here, up to the limit, and replayed to the app, so that a chunked
    upload without Content-Length is limited too.
    """

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.api_key is not None and scope["path"].startswith("/v1"):
            headers = dict(scope["headers"])
            auth = headers.get(b"authorization", b"").decode("latin-1")
            if not secrets.compare_digest(auth, f"Bearer {self.api_key}"):
                await error_response("Invalid or missing API key.", 401)(scope, receive, send)
                return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        too_large = error_response(f"Request body is larger than {self.max_body_bytes} bytes.", 413)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await too_large(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await too_large(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _param_of(loc: tuple | list) -> str | None:
    # ("body", "messages", 0, "content") -> "messages"; JSON errors have only ("body", pos).
    names = [str(p) for p in loc[1:] if isinstance(p, str)] if loc and loc[0] == "body" else []
    return names[0] if names else None


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc.message, exc.status, exc.param)

    @app.exception_handler(ClientDisconnected)
    async def client_disconnected(request: Request, exc: ClientDisconnected) -> Response:
        client = request.client
        logger.info(
            "%s: the client%s went away before the answer; its request was aborted",
            exc,
            f" {client.host}:{client.port}" if client else "",
        )
        # Nobody reads it: 499, nginx's "client closed request", for access logs.
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = first.get("loc", ())
        if first.get("type") == "json_invalid":
            return error_response(f"Invalid JSON body: {first.get('msg', '')}", 400)
        where = ".".join(str(p) for p in loc[1:]) or "body"
        message = f"{where}: {first.get('msg', 'invalid value')}"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more error(s))"
        return error_response(message, 400, _param_of(loc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in a request")
        return error_response(f"Internal server error: {exc!r}", 500)


def build_app(async_llm: AsyncLLM, args: argparse.Namespace | Any) -> FastAPI:
    """The FastAPI app serving `async_llm`, configured from the serve arguments."""
    names = getattr(args, "served_model_name", None) or async_llm.model_config.served_model_name
    served = [names] if isinstance(names, str) else list(names)
    chat_template = load_chat_template(getattr(args, "chat_template", None))
    completion = OpenAIServingCompletion(async_llm, served)
    chat = OpenAIServingChat(
        async_llm,
        served,
        chat_template,
        enable_auto_tools=bool(getattr(args, "enable_auto_tool_choice", False)),
        tool_parser=getattr(args, "tool_call_parser", None),
    )
    tokenization = OpenAIServingTokenization(async_llm, served, chat_template)
    as_token_ids = bool(getattr(args, "return_tokens_as_token_ids", False))
    completion.return_tokens_as_token_ids = chat.return_tokens_as_token_ids = as_token_ids
    max_model_len = async_llm.model_config.max_model_len

    app = FastAPI(title="decodegraph OpenAI-compatible server", version=VERSION)
    app.state.async_llm = async_llm
    app.add_middleware(
        GuardMiddleware,
        api_key=getattr(args, "api_key", None),
        max_body_bytes=getattr(args, "max_request_body_bytes", None)
        or DEFAULT_MAX_REQUEST_BODY_BYTES,
    )
    _install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine thread is alive, 503 once it has failed."""
        if async_llm.errored:
            return error_response("The engine is not running.", 503)
        return Response(status_code=200)

    @app.get("/ping")
    async def ping() -> Response:
        """vLLM's /ping (SageMaker-style probes, GET or POST): /health's answer."""
        return await health()

    @app.post("/ping")
    async def ping_post() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(async_llm.metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[model_card(name) for name in served])

    def model_card(name: str) -> ModelCard:
        return ModelCard(
            id=name, root=str(async_llm.model_config.model), max_model_len=max_model_len
        )

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERROR_RESPONSES)
    async def retrieve_model(model_id: str) -> ModelCard:
        completion.check_model(model_id)
        return model_card(model_id)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERROR_RESPONSES)
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        return tokenization.create_tokenize(request)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERROR_RESPONSES)
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        return tokenization.create_detokenize(request)

    if getattr(args, "enable_tokenizer_info_endpoint", False):

        @app.get("/tokenizer_info")
        async def tokenizer_info() -> dict[str, Any]:
            return tokenization.get_tokenizer_info()

    @app.post("/v1/completions", responses=_ERROR_RESPONSES)
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        return await completion.create_completion(request, raw_request)

    @app.post("/v1/chat/completions", responses=_ERROR_RESPONSES)
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat.create_chat_completion(request, raw_request)

    return app


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the serve flags and the engine flags to `parser`."""
    from decodegraph.engine.arg_utils import EngineArgs

    parser.add_argument("--host", default="127.0.0.1", help="address to bind (loopback)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes"
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        help="Jinja chat template: a file path or the template itself",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model call tools by itself (tool_choice "auto"); needs --tool-call-parser',
    )
    parser.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="how to find tool calls in the model's text (vLLM's parser names)",
    )
    parser.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="larger request bodies get a 413",
    )
    parser.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help='logprob tokens as "token_id:N" (for tokens that are not valid UTF-8 alone)',
    )
    parser.add_argument(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="serve GET /tokenizer_info (the tokenizer's configuration and chat template)",
    )
    parser.add_argument(
        "--engine-core-process",
        action=argparse.BooleanOptionalAction,
        default=DEFAULT_ENGINE_CORE_PROCESS,
        help="run the engine core (scheduler, executor, its workers) in a process of its "
        "own, off the server's GIL (docs/performance.md, server throughput)",
    )
    parser.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
    )
    # MODEL is positional, as in `vllm serve MODEL`.
    EngineArgs.add_cli_args(parser, model_positional=True)
    if "--served-model-name" not in parser._option_string_actions:
        parser.add_argument(
            "--served-model-name", default=None, help="the model name clients send (default: MODEL)"
        )
    return parser


def add_serve_subcommand(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `serve` to the `decodegraph` CLI; it runs `run_server`."""
    parser = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible server",
        description="Serve MODEL over an OpenAI-compatible API.",
    )
    make_arg_parser(parser)
    parser.set_defaults(func=run_server)
    return parser


def build_async_llm(args: argparse.Namespace) -> AsyncLLM:
    """Build the engine from the parsed serve arguments (its core in its own process
    with --engine-core-process) and start its thread."""
    from decodegraph.engine.arg_utils import EngineArgs, UsageContext

    return AsyncLLM.from_engine_args(
        EngineArgs.from_cli_args(args),
        UsageContext.OPENAI_API_SERVER,
        engine_core_process=getattr(args, "engine_core_process", DEFAULT_ENGINE_CORE_PROCESS),
    )


def run_server(args: argparse.Namespace) -> None:
    """Build the engine and serve it with uvicorn until interrupted."""
    import uvicorn

    if getattr(args, "enable_auto_tool_choice", False) and not getattr(
        args, "tool_call_parser", None
    ):
        raise SystemExit(
            "error: when --enable-auto-tool-choice is set, --tool-call-parser must be set"
        )
    sys.setswitchinterval(SERVER_SWITCH_INTERVAL_S)
    async_llm = build_async_llm(args)
    app = build_app(async_llm, args)
    logger.info(
        "serving %s on http://%s:%d", async_llm.model_config.served_model_name, args.host, args.port
    )
    try:
        uvicorn.run(
            app,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            timeout_keep_alive=5,
        )
    finally:
        async_llm.shutdown()


__all__ = ["add_serve_subcommand", "build_app", "error_body", "make_arg_parser", "run_server"]
