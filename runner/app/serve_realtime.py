"""`/v1/realtime`: OpenAI's Realtime transcription events over a WebSocket, into a realtime bundle's streams.

    client -> server                     server -> client
    session.update {session}             session.created (on connect), session.updated {session}
    input_audio_buffer.append {audio}    conversation.item.input_audio_transcription.delta {item_id, delta}
    input_audio_buffer.commit            input_audio_buffer.committed, then ...transcription.completed {transcript}
    input_audio_buffer.clear             input_audio_buffer.cleared
                                         error {error: {type, code, message, param, event_id}}

`audio` is base64 PCM16 (s16le) mono at 16 kHz. An utterance's first append opens a stream on the model, commit
finishes it (its transcript is `stream --json`'s text of the same samples); the connection stays open for the next.
The model holds one stream at a time: a connection's utterance takes the one slot from its first append to its
commit (or clear, or disconnect), and the others wait for it, in order, at most --max-queue of them. Every call into
the model runs on one thread of its own (the KV cache is shared state)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor

from starlette.websockets import WebSocket, WebSocketDisconnect

from runner.errors import RunnerError

log = logging.getLogger(__name__)

DELTA = "conversation.item.input_audio_transcription.delta"
COMPLETED = "conversation.item.input_audio_transcription.completed"


class EventError(Exception):
    """A client event refused: an `error` event goes back, the connection goes on."""

    def __init__(self, message: str, code: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.code, self.param, self.kind = code, param, kind


class Realtime:
    """The realtime side of one served Model: its one stream slot, the queue before it and the thread that runs
    the model. `close()` waits for what that thread is running."""

    def __init__(self, model, max_waiting: int):
        self.model, self.max_waiting = model, max_waiting
        self.waiting = 0  # connections waiting for the slot
        self._slot: asyncio.Lock | None = None  # made on the server's loop, at first use
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="runner-realtime")

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    async def call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def acquire(self) -> None:
        if self._slot is None:
            self._slot = asyncio.Lock()
        if self._slot.locked() and self.waiting >= self.max_waiting:
            raise EventError(
                f"the server is busy ({self.max_waiting} streams waiting): try again",
                "queue_full",
                kind="rate_limit_error",
            )
        self.waiting += 1
        try:
            await self._slot.acquire()
        finally:
            self.waiting -= 1

    def release(self) -> None:
        self._slot.release()

    async def serve(self, websocket: WebSocket) -> None:
        """One accepted connection, until the client goes."""
        connection = _Connection(self, websocket)
        try:
            await connection.run()
        except WebSocketDisconnect:
            pass
        finally:
            await connection.drop()


class _Connection:
    """One client's session: its settings and the utterance it is streaming (if any)."""

    def __init__(self, realtime: Realtime, websocket: WebSocket):
        self.realtime, self.ws = realtime, websocket
        self.session = {"id": f"sess_{uuid.uuid4().hex}", "object": "realtime.transcription_session"}
        self.session["model"] = realtime.model.name
        self.stream = None
        self.item_id: str | None = None
        self.sent = 0  # the stream's deltas already sent
        self.handlers = {
            "session.update": self._update,
            "input_audio_buffer.append": self._append,
            "input_audio_buffer.commit": self._commit,
            "input_audio_buffer.clear": self._clear,
        }

    async def run(self) -> None:
        await self.ws.accept()
        await self.send("session.created", session=self.session)
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            event_id = None
            try:
                event = _event(message)
                event_id = event.get("event_id") if isinstance(event.get("event_id"), str) else None
                await self.handlers[event["type"]](event)
            except EventError as e:
                await self.error(e, event_id)

    async def send(self, kind: str, **fields) -> None:
        await self.ws.send_text(json.dumps({"type": kind, "event_id": f"event_{uuid.uuid4().hex}", **fields}))

    async def error(self, e: EventError, event_id: str | None) -> None:
        error = {"type": e.kind, "code": e.code, "message": str(e), "param": e.param, "event_id": event_id}
        await self.send("error", error=error)

    async def _update(self, event: dict) -> None:
        """Settings merged and echoed; none changes the transcript (the bundle decides language and delay)."""
        session = event.get("session", {})
        if not isinstance(session, dict):
            raise EventError("session.update: `session` must be an object", "invalid_value", "session")
        model = session.get("model")
        if model is not None and model != self.realtime.model.name:
            raise EventError(
                f"The model `{model}` does not exist: this server has `{self.realtime.model.name}`",
                "model_not_found",
                "session.model",
            )
        self.session.update({k: v for k, v in session.items() if k not in ("id", "object")})
        await self.send("session.updated", session=self.session)

    async def _append(self, event: dict) -> None:
        audio = event.get("audio")
        if not isinstance(audio, str):
            raise EventError("input_audio_buffer.append: `audio` (base64 PCM16) is required", "missing_audio", "audio")
        try:
            pcm = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise EventError(
                "input_audio_buffer.append: `audio` is not valid base64", "invalid_base64", "audio"
            ) from None
        if self.stream is None:
            await self._open()
        try:
            await self.realtime.call(self.stream.push, pcm)
        except RunnerError as e:
            await self._end()
            raise EventError(f"the stream failed ({e}); its utterance is dropped", "stream_failed") from None
        await self._deltas()

    async def _commit(self, event: dict) -> None:
        if self.stream is None:
            raise EventError(
                "input_audio_buffer.commit: the buffer is empty (append audio first)",
                "input_audio_buffer_commit_empty",
            )
        stream, item_id = self.stream, self.item_id
        await self.send("input_audio_buffer.committed", item_id=item_id, previous_item_id=None)
        try:
            t = await self.realtime.call(stream.finish)
        except RunnerError as e:
            raise EventError(f"the stream failed ({e}); its utterance is dropped", "stream_failed") from None
        finally:
            await self._end()
        await self._deltas(stream, item_id)
        await self.send(COMPLETED, item_id=item_id, content_index=0, transcript=t.text)

    async def _clear(self, event: dict) -> None:
        await self.drop()
        await self.send("input_audio_buffer.cleared")

    async def _open(self) -> None:
        await self.realtime.acquire()
        try:
            self.stream = await self.realtime.call(self.realtime.model.stream)
        except BaseException:
            self.realtime.release()
            raise
        self.item_id, self.sent = f"item_{uuid.uuid4().hex}", 0

    async def _deltas(self, stream=None, item_id: str | None = None) -> None:
        stream = stream or self.stream
        fresh, self.sent = stream.deltas[self.sent :], len(stream.deltas)
        for d in fresh:
            await self.send(DELTA, item_id=item_id or self.item_id, content_index=0, delta=d.text)

    async def _end(self) -> None:
        """The utterance's stream closed (a finished one already is) and the slot given back."""
        stream, self.stream = self.stream, None
        if stream is not None:
            with contextlib.suppress(Exception):
                await self.realtime.call(stream.close)
            self.realtime.release()

    async def drop(self) -> None:
        """The utterance in progress abandoned (clear, or the client went)."""
        await self._end()


def _event(message: dict) -> dict:
    """A client event from a WebSocket message: a JSON object with a known `type`."""
    text = message.get("text")
    if text is None:
        raise EventError("send each event as a JSON text message, not binary", "invalid_event")
    try:
        event = json.loads(text)
    except json.JSONDecodeError as e:
        raise EventError(f"the event is not JSON ({e.msg} at character {e.pos})", "invalid_json") from None
    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
        raise EventError("an event is a JSON object with a `type`", "invalid_event", "type")
    if event["type"] not in _KNOWN:
        raise EventError(
            f"unknown event type {event['type'][:100]!r}: one of {', '.join(_KNOWN)}", "unknown_event_type", "type"
        )
    return event


_KNOWN = ("session.update", "input_audio_buffer.append", "input_audio_buffer.commit", "input_audio_buffer.clear")
