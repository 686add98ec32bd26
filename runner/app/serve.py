"""`python -m runner serve`: one loaded bundle answering OpenAI-style transcription requests over HTTP.

    GET  /health                    {"status": "ok"} (no key needed)
    GET  /v1/models                 the one model: the bundle's name
    POST /v1/audio/transcriptions   multipart `file`, `model`, `language`, `prompt`, `temperature`,
                                    `response_format` (json|text|srt|vtt|verbose_json), `timestamp_granularities[]`
    GET  /metrics                   Prometheus text
    WS   /v1/realtime               a realtime bundle's streams, as OpenAI's Realtime transcription events
                                    (runner/app/serve_realtime.py)

One engine thread owns the Model (its KV cache is shared state) and runs the requests as one continuous batch
(runner/app/serve_engine.py): requests wait in a bounded queue, and each joins a free slot of the running batch
(up to --max-batch) as soon as it arrives, while the others decode; requests that ask other options (language,
prompt, temperature) wait for the batch to drain, in arrival order. The event loop only reads uploads and
answers; each request's future is settled from the engine thread."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import queue
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

try:
    import uvicorn
    from prometheus_client import CONTENT_TYPE_LATEST
    from starlette.applications import Starlette
    from starlette.datastructures import FormData
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect, HTTPConnection, Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route, WebSocketRoute
    from starlette.websockets import WebSocket
except ImportError as e:  # the verb says which extra brings them
    raise ImportError(f"{e}: install the serve extra (pip install 'voxtral-aoti-runner[serve]')") from e

from runner.app.os_errors import reason
from runner.app.serve_args import ServeOptions
from runner.app.serve_engine import Engine, Submission
from runner.app.serve_metrics import Metrics
from runner.app.serve_openai import (
    FORMATS,
    GRANULARITIES,
    ApiError,
    Options,
    TooLarge,
    limited_receive,
    read_upload,
    render,
    temperature_field,
    text_field,
)
from runner.app.serve_realtime import Realtime
from runner.errors import AudioError, RunnerError

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1
MAX_FIELDS = 32  # model, language, prompt, temperature, response_format, granularities: a few, never thousands


# ---------------------------------------------------------------- the HTTP side


class Service:
    """The routes over one loaded Model and its engine thread; `app` is the ASGI application, `close()` stops
    the engine (what is queued finishes first). The model stays the caller's to close."""

    def __init__(self, model, options: ServeOptions):
        self.model, self.options = model, options
        self.max_batch = _max_batch(model, options.max_batch)
        self.metrics = Metrics()
        self.engine = Engine(model, self.max_batch, options.max_queue, options.max_new_tokens, self.metrics)
        self.metrics.queue.set_function(self.engine.depth)
        self.created = int(time.time())
        self.realtime = Realtime(model, options.max_queue, options.realtime_idle_s)
        self.app = Starlette(
            routes=[
                self._route("/health", self._health, auth=False),
                self._route("/v1/models", self._models),
                self._route("/v1/audio/transcriptions", self._transcriptions, methods=["POST"]),
                self._route("/metrics", self._metrics),
                WebSocketRoute("/v1/realtime", self._realtime),
            ]
        )
        self.engine.start()

    def close(self) -> None:
        self.engine.stop()
        self.realtime.close()

    def _route(self, path: str, handler: Callable, methods=("GET",), auth: bool = True) -> Route:
        """The route with the key check, OpenAI-style errors and its metrics around the handler."""

        async def endpoint(request: Request) -> Response:
            t0 = time.perf_counter()
            try:
                if auth:
                    self._authorize(request)
                response = await handler(request)
            except ApiError as e:
                response = e.response()
            except ClientDisconnect:  # nobody reads this answer; counted as nginx counts it
                response = Response(status_code=499)
            except Exception:
                log.exception("%s failed", path)
                response = ApiError(500, "the server failed on this request", kind="server_error").response()
            self.metrics.requests.labels(path, str(response.status_code)).inc()
            self.metrics.latency.labels(path).observe(time.perf_counter() - t0)
            return response

        return Route(path, endpoint, methods=list(methods))

    def _authorize(self, request: HTTPConnection) -> None:
        key = self.options.api_key
        if key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise ApiError(
                401,
                "Incorrect API key provided: give the server's key as `Authorization: Bearer KEY`",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    async def _realtime(self, websocket: WebSocket) -> None:
        """Refused before the handshake completes (an HTTP answer with OpenAI's error) without the key, or on a
        bundle that does not stream."""
        try:
            self._authorize(websocket)
            if not self.model.capabilities.streaming:
                raise ApiError(
                    404,
                    f"/v1/realtime: `{self.model.name}` is a {self.model.family} bundle, which transcribes whole "
                    "files (POST /v1/audio/transcriptions); serve a realtime bundle to stream",
                    code="model_not_found",
                )
        except ApiError as e:
            await _deny(websocket, e)
            return
        await self.realtime.serve(websocket)

    async def _health(self, request: Request) -> Response:
        if not self.engine.alive:
            return JSONResponse({"status": "stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def _models(self, request: Request) -> Response:
        model = {"id": self.model.name, "object": "model", "created": self.created, "owned_by": "voxtral-runner"}
        return JSONResponse({"object": "list", "data": [model]})

    async def _metrics(self, request: Request) -> Response:
        return Response(self.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    async def _transcriptions(self, request: Request) -> Response:
        form = await self._form(request)
        try:
            fmt, options = self._fields(form)
            audio = await read_upload(form)
        finally:
            await form.close()
        t = await self._submit(audio, options)
        return render(t, fmt, options)

    async def _form(self, request: Request) -> FormData:
        """The multipart form, the body bounded by --max-upload-mb: refused by its Content-Length before any of it
        is read, else as soon as more arrives."""
        limit = self.options.max_upload_bytes
        too_large = ApiError(
            413,
            f"the request body is larger than the server's limit of {limit:,} bytes (--max-upload-mb)",
            param="file",
            code="file_too_large",
        )
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise too_large
        try:
            return await Request(request.scope, limited_receive(request.receive, limit)).form(
                max_files=1, max_fields=MAX_FIELDS
            )
        except TooLarge:
            raise too_large from None
        except HTTPException as e:  # starlette's: a malformed multipart body
            raise ApiError(400, f"the form: {e.detail}") from None

    def _fields(self, form: FormData) -> tuple[str, Options]:
        """The response format and the model's options from the form, each checked; defaults as `run`'s."""
        model = text_field(form, "model")
        if model is not None and model != self.model.name:
            raise ApiError(
                404,
                f"The model `{model}` does not exist: this server has `{self.model.name}`",
                param="model",
                code="model_not_found",
            )
        fmt = text_field(form, "response_format") or "json"
        if fmt not in FORMATS:
            raise ApiError(400, f"response_format {fmt!r}: one of {', '.join(FORMATS)}", param="response_format")
        options = Options(
            text_field(form, "language"), text_field(form, "prompt"), temperature_field(form), self._words(form)
        )
        return fmt, options

    def _words(self, form: FormData) -> bool:
        param = "timestamp_granularities[]"
        asked = [v for name in (param, "timestamp_granularities") for v in form.getlist(name)]
        for value in asked:
            if value not in GRANULARITIES:
                raise ApiError(400, f"{param} {value!r}: segment or word", param=param)
        words = "word" in asked
        if words and not self.model.capabilities.word_timestamps:
            raise ApiError(
                400,
                f"{param} word: a {self.model.family} model gives no word times (its segments are its windows)",
                param=param,
            )
        return words

    async def _submit(self, audio: bytes, options: Options):
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        try:
            self.engine.submit(Submission(audio, options, loop, future))
        except queue.Full:
            raise ApiError(
                429,
                f"the server is busy ({self.options.max_queue} requests waiting): try again",
                code="queue_full",
                kind="rate_limit_error",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None
        try:
            return await future
        except AudioError as e:
            raise ApiError(400, str(e), param="file", code="invalid_audio") from None
        except RunnerError as e:
            raise ApiError(400, str(e)) from None


async def _deny(websocket: WebSocket, error: ApiError) -> None:
    """The error as an HTTP answer to the handshake where the server can give one, else a close with its reason
    (1008: policy; the reason is at most 123 bytes)."""
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(error.response())
    else:
        await websocket.close(code=1008, reason=str(error).encode()[:123].decode(errors="ignore"))


def _max_batch(model, asked: int | None) -> int:
    if asked is None:
        return model.max_batch
    if asked > model.max_batch:
        raise RunnerError(
            f"--max-batch {asked}: {model.name} decodes at most {model.max_batch} at once; export it with "
            f"--max-batch {asked} (or more), or serve with a smaller --max-batch"
        )
    return asked


# ---------------------------------------------------------------- the verb


def main(args) -> int:
    from runner.app.api import Model  # torch

    options = ServeOptions.from_args(args)
    sock = _listen(options.host, options.port)  # a port in use fails before the model loads
    with contextlib.closing(sock), Model(args.bundle, args.runtime) as model, _private_tempdir():
        service = Service(model, options)
        try:
            return _serve(service, sock, args.verbose)
        finally:
            service.close()


def _serve(service: Service, sock: socket.socket, verbose: int) -> int:
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(
        service.app,
        log_level="info" if verbose else "warning",
        lifespan="off",
        access_log=verbose > 1,
        timeout_graceful_shutdown=None,
    )
    server = uvicorn.Server(config)
    key = "a key (Authorization: Bearer)" if service.options.api_key else "no key"
    print(f"serving {service.model.name} on http://{host}:{port} ({key}); Ctrl-C or SIGTERM stops", file=sys.stderr)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # the signal uvicorn took, raised again after its graceful shutdown
        pass
    return 0


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)  # connections wait in the backlog from here, while the model loads
    except OSError as e:
        sock.close()
        raise RunnerError(f"--host {host} --port {port}: cannot listen there ({reason(e)})") from None
    return sock


@contextlib.contextmanager
def _private_tempdir() -> Iterator[str]:
    """Every temporary file of a request (an upload spooled to disk, the audio the model reads) in a folder only
    this user reads, removed when the server stops."""
    path = tempfile.mkdtemp(prefix="runner-serve-")
    previous, tempfile.tempdir = tempfile.tempdir, path
    try:
        yield path
    finally:
        tempfile.tempdir = previous
        shutil.rmtree(path, ignore_errors=True)
