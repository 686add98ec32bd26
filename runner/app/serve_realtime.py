"""`/v1/realtime`: OpenAI's Realtime transcription events over a WebSocket, into a realtime bundle's streams.

    client -> server                     server -> client
    session.update {session}             session.created (on connect), session.updated {session}
    input_audio_buffer.append {audio}    conversation.item.input_audio_transcription.delta {item_id, delta}
    input_audio_buffer.commit            input_audio_buffer.committed, then ...transcription.completed {transcript}
    input_audio_buffer.clear             input_audio_buffer.cleared
                                         error {error: {type, code, message, param, event_id}}

`audio` is base64 PCM16 (s16le) mono at 16 kHz. An utterance's first append opens a stream on the model, commit
finishes it (its transcript is `stream --json`'s text of the same samples); the connection stays open for the next.
The bundle's stream slots (its export's --max-streams) serve as many utterances at once, stepped together on the
stream engine's thread (runner/app/serve_streams.py), each one's text what it gets alone; an utterance takes a slot
from its first append to its commit (or clear, or disconnect), and past the slots connections wait for one, in
order, at most --max-queue of them. A connection that sends nothing for --realtime-idle-s gets an `idle_timeout`
error event and is closed, its slot given back."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import uuid
from functools import partial

from starlette.websockets import WebSocket, WebSocketDisconnect

from runner.app.serve_streams import StreamEngine
from runner.errors import RunnerError

DELTA = "conversation.item.input_audio_transcription.delta"
COMPLETED = "conversation.item.input_audio_transcription.completed"


class EventError(Exception):
    """A client event refused: an `error` event goes back, the connection goes on."""

    def __init__(self, message: str, code: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.code, self.param, self.kind = code, param, kind


class Realtime:
    """The realtime side of one served Model: its stream slots, the queue before them and the engine whose thread
    runs the model. `close()` waits for that thread to end."""

    def __init__(self, model, max_waiting: int, idle_s: float):
        self.model, self.max_waiting, self.idle_s = model, max_waiting, idle_s
        self.waiting = 0  # connections waiting for a slot
        self.streaming = 0  # connections with an utterance in a slot
        self.engine = StreamEngine(model)
        self._slots: asyncio.Semaphore | None = None  # made on the server's loop, at first use

    def close(self) -> None:
        self.engine.stop()

    async def acquire(self) -> None:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.model.max_streams)
        if self._slots.locked() and self.waiting >= self.max_waiting:
            raise EventError(
                f"the server is busy ({self.max_waiting} streams waiting): try again",
                "queue_full",
                kind="rate_limit_error",
            )
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.streaming += 1

    def release(self) -> None:
        self.streaming -= 1
        self._slots.release()

    async def serve(self, websocket: WebSocket) -> None:
        """One accepted connection, until the client goes (or idles past idle_s)."""
        self.engine.start()
        connection = _Connection(self, websocket)
        try:
            await connection.run()
        except WebSocketDisconnect:
            pass
        finally:
            await connection.drop()
            await connection.flush()


class _Connection:
    """One client's session: its settings, the utterance it is streaming (if any), and the events going back, sent
    in order by a writer task of its own (deltas come from the engine's thread, between the replies)."""

    def __init__(self, realtime: Realtime, websocket: WebSocket):
        self.realtime, self.ws = realtime, websocket
        self.session = {"id": f"sess_{uuid.uuid4().hex}", "object": "realtime.transcription_session"}
        self.session["model"] = realtime.model.name
        self.stream = None
        self.item_id: str | None = None
        self.loop = asyncio.get_running_loop()
        self.outbox: asyncio.Queue[str | None] = asyncio.Queue()
        self.writer: asyncio.Task | None = None
        self.handlers = {
            "session.update": self._update,
            "input_audio_buffer.append": self._append,
            "input_audio_buffer.commit": self._commit,
            "input_audio_buffer.clear": self._clear,
        }

    async def run(self) -> None:
        await self.ws.accept()
        self.writer = asyncio.create_task(self._write())
        self.send("session.created", session=self.session)
        while True:
            try:
                message = await asyncio.wait_for(self.ws.receive(), self.realtime.idle_s)
            except asyncio.TimeoutError:  # TimeoutError from Python 3.11 on
                await self._idle()
                return
            if message["type"] == "websocket.disconnect":
                return
            event_id = None
            try:
                event = _event(message)
                event_id = event.get("event_id") if isinstance(event.get("event_id"), str) else None
                await self.handlers[event["type"]](event)
            except EventError as e:
                self.error(e, event_id)

    def send(self, kind: str, **fields) -> None:
        self.outbox.put_nowait(json.dumps({"type": kind, "event_id": f"event_{uuid.uuid4().hex}", **fields}))

    def error(self, e: EventError, event_id: str | None) -> None:
        error = {"type": e.kind, "code": e.code, "message": str(e), "param": e.param, "event_id": event_id}
        self.send("error", error=error)

    async def _write(self) -> None:
        """The events in the order sent, until flush() (or until the client is gone)."""
        while (text := await self.outbox.get()) is not None:
            await self.ws.send_text(text)

    async def flush(self) -> None:
        """The events queued sent (where the client still takes them), and the writer ended."""
        writer, self.writer = self.writer, None
        if writer is not None:
            self.outbox.put_nowait(None)
            with contextlib.suppress(Exception):
                await writer

    async def _idle(self) -> None:
        """Nothing from the client for idle_s: an error event says so, the utterance is dropped (its slot given
        back) and the connection closed."""
        idle = self.realtime.idle_s
        message = f"no event for {idle:g} s: the session is closed (the server's --realtime-idle-s)"
        self.error(EventError(message, "idle_timeout"), None)
        await self.drop()
        await self.flush()
        with contextlib.suppress(Exception):  # the client may be gone already
            await self.ws.close(code=1000, reason="idle timeout")

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
        self.send("session.updated", session=self.session)

    async def _append(self, event: dict) -> None:
        """The audio into the utterance's stream, answered once the engine has stepped it (its deltas sent)."""
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
            await self.realtime.engine.feed(self.stream, pcm)
        except RunnerError as e:
            await self._end()
            raise EventError(f"the stream failed ({e}); its utterance is dropped", "stream_failed") from None

    async def _commit(self, event: dict) -> None:
        if self.stream is None:
            raise EventError(
                "input_audio_buffer.commit: the buffer is empty (append audio first)",
                "input_audio_buffer_commit_empty",
            )
        stream, item_id = self.stream, self.item_id
        self.send("input_audio_buffer.committed", item_id=item_id, previous_item_id=None)
        try:
            t = await self.realtime.engine.finish(stream)  # its last deltas are queued before this returns
        except RunnerError as e:
            raise EventError(f"the stream failed ({e}); its utterance is dropped", "stream_failed") from None
        finally:
            await self._end()
        self.send(COMPLETED, item_id=item_id, content_index=0, transcript=t.text)

    async def _clear(self, event: dict) -> None:
        await self.drop()
        self.send("input_audio_buffer.cleared")

    async def _open(self) -> None:
        """A slot (waiting for one in the queue), and a stream in it whose deltas are sent as they come."""
        await self.realtime.acquire()
        item_id = f"item_{uuid.uuid4().hex}"
        try:
            self.stream = await self.realtime.engine.open(partial(self._delta, item_id))
        except RunnerError as e:
            self.realtime.release()
            raise EventError(f"the stream could not open ({e})", "stream_failed") from None
        except BaseException:
            self.realtime.release()
            raise
        self.item_id = item_id

    def _delta(self, item_id: str, delta) -> None:
        """A delta the engine decided, on its thread: sent in turn on the server's loop."""
        event = partial(self.send, DELTA, item_id=item_id, content_index=0, delta=delta.text)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is left to tell
            self.loop.call_soon_threadsafe(event)

    async def _end(self) -> None:
        """The utterance's stream closed (a finished one already is) and the slot given back."""
        stream, self.stream = self.stream, None
        if stream is not None:
            with contextlib.suppress(Exception):
                await self.realtime.engine.close(stream)
            self.realtime.release()

    async def drop(self) -> None:
        """The utterance in progress abandoned (clear, idle, or the client went)."""
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
