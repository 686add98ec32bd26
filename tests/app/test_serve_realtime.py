"""`/v1/realtime` (runner/app/serve_realtime.py): a live server on loopback with a tiny-realtime bundle, spoken to
by the `websockets` client as OpenAI's Realtime transcription events; each transcript checked against `python -m
runner stream --json`'s record of the same PCM."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
import websockets
from conftest import AUDIO
from live_server import running
from websockets.asyncio.client import connect

import runner
from runner.app.cli import main
from runner.app.serve import Service
from runner.app.serve_args import ServeOptions
from runner.audio import load_audio

KEY = "sk-test-rt-51c2"
BLOCK = 2 * 1280  # 80 ms of s16le at 16 kHz
DELTA = "conversation.item.input_audio_transcription.delta"
COMPLETED = "conversation.item.input_audio_transcription.completed"


def pcm_of(name: str) -> bytes:
    samples = load_audio(AUDIO / name)
    return (np.clip(samples, -1, 1 - 2**-15) * 32768).astype("<i2").tobytes()


@contextlib.contextmanager
def serving(model, **options):
    """A Service on a free loopback port, uvicorn in a thread; yields the ws:// URL of /v1/realtime."""
    service = Service(model, ServeOptions(port=0, **options))
    with running(service) as port:
        yield f"ws://127.0.0.1:{port}/v1/realtime", service


def client(url: str, key: str | None = None):
    headers = {"Authorization": f"Bearer {key}"} if key else None
    return connect(url, additional_headers=headers, proxy=None, open_timeout=120, ping_interval=None)


async def send(ws, kind: str, **fields) -> None:
    await ws.send(json.dumps({"type": kind, **fields}))


async def next_event(ws) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), 300))


async def utterance(ws, pcm: bytes) -> tuple[list[str], str, list[dict]]:
    """The PCM in 80 ms appends, then commit: (the deltas, the completed transcript, every event in order)."""

    async def read() -> list[dict]:
        events = []
        while not events or events[-1]["type"] != COMPLETED:
            events.append(await next_event(ws))
            assert events[-1]["type"] != "error", events[-1]
        return events

    reader = asyncio.create_task(read())
    for i in range(0, len(pcm), BLOCK):
        await send(ws, "input_audio_buffer.append", audio=base64.b64encode(pcm[i : i + BLOCK]).decode())
    await send(ws, "input_audio_buffer.commit")
    events = await reader
    deltas = [e["delta"] for e in events if e["type"] == DELTA]
    ids = {e["item_id"] for e in events if e["type"] in (DELTA, COMPLETED)}
    assert len(ids) == 1 and [e["type"] for e in events].count("input_audio_buffer.committed") == 1
    return deltas, events[-1]["transcript"], events


def stream_json_text(capsys, monkeypatch, bundle: Path, pcm: bytes) -> str:
    """`python -m runner stream --json --audio -`'s text of this s16le PCM on stdin."""
    capsys.readouterr()
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(pcm)))
    assert main(["stream", "--bundle", str(bundle), "--audio", "-", "--json"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    return json.loads(line)["text"]


def error_of(event: dict, code: str) -> dict:
    assert event["type"] == "error", event
    error = event["error"]
    assert error["code"] == code and error["type"] and error["message"] and "Traceback" not in error["message"]
    return error


@pytest.fixture(scope="module")
def realtime(realtime_bundle):
    with runner.load(realtime_bundle) as model:
        yield model


@pytest.fixture(scope="module")
def live(realtime):
    with serving(realtime) as (url, _):
        yield url


# ---------------------------------------------------------------- utterances: stream --json's text


def test_utterances_on_one_connection_give_stream_json_text(live, realtime, realtime_bundle, capsys, monkeypatch):
    speech, short = pcm_of("speech.wav"), pcm_of("short.wav")

    async def talk():
        async with client(live) as ws:
            created = await next_event(ws)
            assert created["type"] == "session.created" and created["session"]["model"] == realtime.name
            await send(ws, "session.update", session={"model": realtime.name, "no_such_field": 1})
            updated = await next_event(ws)
            assert updated["type"] == "session.updated" and updated["session"]["no_such_field"] == 1
            return await utterance(ws, speech), await utterance(ws, short)

    (d1, t1, e1), (d2, t2, e2) = asyncio.run(talk())
    assert t1 and "".join(d1) == t1 == stream_json_text(capsys, monkeypatch, realtime_bundle, speech)
    assert "".join(d2) == t2 == stream_json_text(capsys, monkeypatch, realtime_bundle, short)
    assert e1[-1]["item_id"] != e2[-1]["item_id"]
    kinds = [e["type"] for e in e1]  # deltas as the tokens are decided, before the commit
    assert kinds.index(DELTA) < kinds.index("input_audio_buffer.committed")


def test_a_client_gone_mid_utterance_gives_the_stream_back(live, realtime_bundle, capsys, monkeypatch):
    short = pcm_of("short.wav")

    async def talk():
        async with client(live) as ws:
            assert (await next_event(ws))["type"] == "session.created"
            await send(ws, "input_audio_buffer.append", audio=base64.b64encode(short[:BLOCK]).decode())
        async with client(live) as ws:
            assert (await next_event(ws))["type"] == "session.created"
            return await utterance(ws, short)

    deltas, transcript, _ = asyncio.run(talk())
    assert "".join(deltas) == transcript == stream_json_text(capsys, monkeypatch, realtime_bundle, short)


def test_two_clients_at_once_each_get_their_own_text(live, realtime_bundle, capsys, monkeypatch):
    pcms = [pcm_of("speech.wav"), pcm_of("short.wav")]

    async def one(pcm: bytes):
        async with client(live) as ws:
            assert (await next_event(ws))["type"] == "session.created"
            return await utterance(ws, pcm)

    async def both():
        return await asyncio.gather(*(one(p) for p in pcms))

    results = asyncio.run(both())
    for pcm, (deltas, transcript, _) in zip(pcms, results):
        assert "".join(deltas) == transcript == stream_json_text(capsys, monkeypatch, realtime_bundle, pcm)
    assert results[0][1] != results[1][1]


def test_a_third_client_past_the_queue_is_told_busy(realtime):
    pcm = pcm_of("short.wav")

    async def scene(url: str, service: Service):
        async with client(url) as a, client(url) as b, client(url) as c:
            for ws in (a, b, c):
                assert (await next_event(ws))["type"] == "session.created"
            chunk = base64.b64encode(pcm[:BLOCK]).decode()
            await send(a, "input_audio_buffer.append", audio=chunk)  # a holds the stream
            await send(b, "input_audio_buffer.append", audio=chunk)
            while service.realtime.waiting == 0:  # b waits for it, filling the queue of one
                await asyncio.sleep(0.01)
            await send(c, "input_audio_buffer.append", audio=chunk, event_id="evt_c")
            error = error_of(await next_event(c), "queue_full")
            assert error["type"] == "rate_limit_error" and error["event_id"] == "evt_c"
            await send(a, "input_audio_buffer.commit")
            events = [await next_event(a)]
            while events[-1]["type"] != COMPLETED:
                events.append(await next_event(a))
            await send(b, "input_audio_buffer.commit")  # b had the slot next
            while (await next_event(b))["type"] != COMPLETED:
                pass

    with serving(realtime, max_queue=1) as (url, service):
        asyncio.run(scene(url, service))


# ---------------------------------------------------------------- bad events: an error event, and on


def test_bad_events_get_error_events_and_the_connection_goes_on(live, realtime_bundle, capsys, monkeypatch):
    short = pcm_of("short.wav")

    async def talk():
        async with client(live) as ws:
            assert (await next_event(ws))["type"] == "session.created"
            await send(ws, "input_audio_buffer.append", audio="not base64!!", event_id="evt_1")
            error = error_of(await next_event(ws), "invalid_base64")
            assert error["param"] == "audio" and error["event_id"] == "evt_1"
            await ws.send("{not json")
            error_of(await next_event(ws), "invalid_json")
            await send(ws, "response.create")
            assert "response.create" in error_of(await next_event(ws), "unknown_event_type")["message"]
            await ws.send(b"\x00\x01")
            error_of(await next_event(ws), "invalid_event")
            await send(ws, "input_audio_buffer.commit")
            error_of(await next_event(ws), "input_audio_buffer_commit_empty")
            await send(ws, "session.update", session={"model": "gpt-4o-transcribe"})
            error_of(await next_event(ws), "model_not_found")
            odd = base64.b64encode(short[: BLOCK + 1]).decode()  # a sample split across appends: held
            await send(ws, "input_audio_buffer.append", audio=odd)
            await send(ws, "input_audio_buffer.clear")  # the utterance dropped, the slot given back
            assert (await next_event(ws))["type"] == "input_audio_buffer.cleared"
            return await utterance(ws, short)

    deltas, transcript, _ = asyncio.run(talk())
    assert "".join(deltas) == transcript == stream_json_text(capsys, monkeypatch, realtime_bundle, short)


# ---------------------------------------------------------------- refused before the handshake


def refused(url: str, key: str | None = None) -> websockets.exceptions.InvalidStatus:
    async def knock():
        async with client(url, key):
            pass

    with pytest.raises(websockets.exceptions.InvalidStatus) as e:
        asyncio.run(knock())
    return e.value


def test_the_key_is_needed(realtime):
    with serving(realtime, api_key=KEY) as (url, _):
        for key in (None, "sk-wrong"):
            response = refused(url, key).response
            assert response.status_code == 401
            assert json.loads(response.body)["error"]["code"] == "invalid_api_key"

        async def knock():
            async with client(url, KEY) as ws:
                return await next_event(ws)

        assert asyncio.run(knock())["type"] == "session.created"


def test_a_whole_file_bundle_refuses_realtime_with_a_reason(tiny_bundle):
    with runner.load(tiny_bundle) as model, serving(model) as (url, _):
        response = refused(url).response
    assert response.status_code == 404
    message = json.loads(response.body)["error"]["message"]
    assert "/v1/audio/transcriptions" in message and "realtime" in message
