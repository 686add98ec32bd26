"""`/v1/realtime` (runner/app/serve_realtime.py, runner/app/serve_streams.py): a live server on loopback with a
tiny-realtime bundle of 4 stream slots, spoken to by the `websockets` client as OpenAI's Realtime transcription
events; each transcript checked against `python -m runner stream --json`'s record of the same PCM, alone."""

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
from conftest import AUDIO, parse_error
from live_server import running
from websockets.asyncio.client import connect

import runner
from runner.app.cli import build_parser, main
from runner.app.options import Environment
from runner.app.serve import Service
from runner.app.serve_args import ServeOptions
from runner.audio import load_audio

KEY = "sk-test-rt-51c2"
BLOCK = 2 * 1280  # 80 ms of s16le at 16 kHz
DELTA = "conversation.item.input_audio_transcription.delta"
COMPLETED = "conversation.item.input_audio_transcription.completed"
FILES = ("speech.wav", "short.wav", "speech_48k_stereo.wav", "long_35s.flac")  # a different one per slot
IDLE_S = 1.0  # the idle test's --realtime-idle-s


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


async def append(ws, pcm: bytes) -> None:
    await send(ws, "input_audio_buffer.append", audio=base64.b64encode(pcm).decode())


async def completed(ws) -> tuple[list[str], str, list[dict]]:
    """The events up to an utterance's completed transcript: (its deltas, the transcript, every event in order)."""
    events = []
    while not events or events[-1]["type"] != COMPLETED:
        events.append(await next_event(ws))
        assert events[-1]["type"] != "error", events[-1]
    deltas = [e["delta"] for e in events if e["type"] == DELTA]
    ids = {e["item_id"] for e in events if e["type"] in (DELTA, COMPLETED)}
    assert len(ids) == 1 and [e["type"] for e in events].count("input_audio_buffer.committed") == 1
    return deltas, events[-1]["transcript"], events


async def utterance(ws, pcm: bytes) -> tuple[list[str], str, list[dict]]:
    """The PCM in 80 ms appends, then commit: (the deltas, the completed transcript, every event in order)."""
    reader = asyncio.create_task(completed(ws))
    for i in range(0, len(pcm), BLOCK):
        await append(ws, pcm[i : i + BLOCK])
    await send(ws, "input_audio_buffer.commit")
    return await reader


async def until(condition, timeout: float = 120) -> None:
    """Wait for the server's state to say so."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the server never got there"
        await asyncio.sleep(0.01)


async def clients(stack: contextlib.AsyncExitStack, url: str, n: int) -> list:
    """n connections, each past its session.created."""
    wss = [await stack.enter_async_context(client(url)) for _ in range(n)]
    for ws in wss:
        assert (await next_event(ws))["type"] == "session.created"
    return wss


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
def realtime(realtime_slots_bundle):
    with runner.load(realtime_slots_bundle) as model:
        assert model.max_streams == len(FILES)
        yield model


@pytest.fixture(scope="module")
def live(realtime):
    with serving(realtime) as (url, _):
        yield url


# ---------------------------------------------------------------- utterances: stream --json's text


def test_utterances_on_one_connection_give_stream_json_text(live, realtime, realtime_slots_bundle, capsys, monkeypatch):
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
    assert t1 and "".join(d1) == t1 == stream_json_text(capsys, monkeypatch, realtime_slots_bundle, speech)
    assert "".join(d2) == t2 == stream_json_text(capsys, monkeypatch, realtime_slots_bundle, short)
    assert e1[-1]["item_id"] != e2[-1]["item_id"]
    kinds = [e["type"] for e in e1]  # deltas as the tokens are decided, before the commit
    assert kinds.index(DELTA) < kinds.index("input_audio_buffer.committed")


def test_a_client_gone_mid_utterance_gives_the_stream_back(live, realtime_slots_bundle, capsys, monkeypatch):
    short = pcm_of("short.wav")

    async def talk():
        async with client(live) as ws:
            assert (await next_event(ws))["type"] == "session.created"
            await send(ws, "input_audio_buffer.append", audio=base64.b64encode(short[:BLOCK]).decode())
        async with client(live) as ws:
            assert (await next_event(ws))["type"] == "session.created"
            return await utterance(ws, short)

    deltas, transcript, _ = asyncio.run(talk())
    assert "".join(deltas) == transcript == stream_json_text(capsys, monkeypatch, realtime_slots_bundle, short)


def test_two_clients_at_once_each_get_their_own_text(live, realtime_slots_bundle, capsys, monkeypatch):
    pcms = [pcm_of("speech.wav"), pcm_of("short.wav")]

    async def one(pcm: bytes):
        async with client(live) as ws:
            assert (await next_event(ws))["type"] == "session.created"
            return await utterance(ws, pcm)

    async def both():
        return await asyncio.gather(*(one(p) for p in pcms))

    results = asyncio.run(both())
    for pcm, (deltas, transcript, _) in zip(pcms, results):
        assert "".join(deltas) == transcript == stream_json_text(capsys, monkeypatch, realtime_slots_bundle, pcm)
    assert results[0][1] != results[1][1]


def test_a_client_per_slot_streams_at_once_and_a_silent_one_holds_nobody_up(
    realtime, realtime_slots_bundle, capsys, monkeypatch
):
    """As many clients as slots, each a different file in appends of its own size (none on a position's edge, odd
    ones splitting a sample), interleaved. The first stops half way: the others stream to the end and get their
    transcripts while it still holds its slot; then it goes on. Each one's text is its file's alone."""
    pcms = [pcm_of(name) for name in FILES]
    sizes = [BLOCK, 1001, 3 * BLOCK + 2, 4097]
    half = len(pcms[0]) // 2

    async def scene(url: str, service: Service):
        async with contextlib.AsyncExitStack() as stack:
            wss = await clients(stack, url, len(pcms))
            readers = [asyncio.create_task(completed(ws)) for ws in wss]
            sent = [0] * len(pcms)

            async def next_append(i: int) -> None:
                await append(wss[i], pcms[i][sent[i] : sent[i] + sizes[i]])
                sent[i] += sizes[i]

            for i in range(len(wss)):
                await next_append(i)
            await until(lambda: service.realtime.streaming == len(wss))  # every slot streams at once
            ends = [half] + [len(p) for p in pcms[1:]]
            while any(s < end for s, end in zip(sent, ends)):
                for i in range(len(wss)):
                    if sent[i] < ends[i]:
                        await next_append(i)
            for ws in wss[1:]:
                await send(ws, "input_audio_buffer.commit")
            others = await asyncio.wait_for(asyncio.gather(*readers[1:]), 300)
            assert service.realtime.streaming == 1 and not readers[0].done()  # the silent one kept its slot
            while sent[0] < len(pcms[0]):
                await next_append(0)
            await send(wss[0], "input_audio_buffer.commit")
            return [await readers[0], *others]

    with serving(realtime) as (url, service):
        results = asyncio.run(scene(url, service))
    texts = [transcript for _, transcript, _ in results]
    for pcm, (deltas, transcript, _) in zip(pcms, results):
        assert "".join(deltas) == transcript == stream_json_text(capsys, monkeypatch, realtime_slots_bundle, pcm)
    assert len(set(texts)) == len(texts) and all(texts)


def test_past_the_slots_a_client_waits_for_one_and_one_more_is_told_busy(
    realtime, realtime_slots_bundle, capsys, monkeypatch
):
    short = pcm_of("short.wav")

    async def scene(url: str, service: Service):
        async with contextlib.AsyncExitStack() as stack:
            *holders, waiter, busy = await clients(stack, url, realtime.max_streams + 2)
            for ws in holders:
                await append(ws, short[:BLOCK])
            await until(lambda: service.realtime.streaming == len(holders))
            served = asyncio.create_task(utterance(waiter, short))  # its first append waits for a slot
            await until(lambda: service.realtime.waiting == 1)  # the queue of one is full
            await send(busy, "input_audio_buffer.append", audio=base64.b64encode(short[:BLOCK]).decode(), event_id="e")
            error = error_of(await next_event(busy), "queue_full")
            assert error["type"] == "rate_limit_error" and error["event_id"] == "e"
            assert not served.done()
            await send(holders[0], "input_audio_buffer.commit")  # its slot goes to the waiter
            await completed(holders[0])
            deltas, transcript, _ = await asyncio.wait_for(served, 300)
            for ws in holders[1:]:
                await send(ws, "input_audio_buffer.commit")
                await completed(ws)
            return deltas, transcript

    with serving(realtime, max_queue=1) as (url, service):
        deltas, transcript = asyncio.run(scene(url, service))
    assert "".join(deltas) == transcript == stream_json_text(capsys, monkeypatch, realtime_slots_bundle, short)


def test_an_idle_client_is_closed_and_its_slot_goes_to_the_next(realtime, realtime_slots_bundle, capsys, monkeypatch):
    """Every slot taken, one client waiting; the others keep talking (session.update), one says nothing: after
    --realtime-idle-s it gets an idle_timeout error, its connection closes and the waiting client has its slot."""
    short = pcm_of("short.wav")

    async def keep_talking(ws, until_done: asyncio.Task) -> None:
        while not until_done.done():
            await send(ws, "session.update", session={})
            while (await next_event(ws))["type"] != "session.updated":
                pass
            await asyncio.sleep(IDLE_S / 5)

    async def scene(url: str, service: Service):
        async with contextlib.AsyncExitStack() as stack:
            silent, *talkers, waiter = await clients(stack, url, realtime.max_streams + 1)
            t0 = asyncio.get_running_loop().time()
            for ws in (silent, *talkers):
                await append(ws, short[:BLOCK])
            await until(lambda: service.realtime.streaming == 1 + len(talkers))
            served = asyncio.create_task(utterance(waiter, short))
            await until(lambda: service.realtime.waiting == 1)
            talking = [asyncio.create_task(keep_talking(ws, served)) for ws in talkers]
            error = error_of(await next_event(silent), "idle_timeout")
            assert asyncio.get_running_loop().time() - t0 >= IDLE_S and "idle" in error["message"]
            with pytest.raises(websockets.exceptions.ConnectionClosedOK):
                await silent.recv()
            deltas, transcript, _ = await asyncio.wait_for(served, 300)
            await asyncio.gather(*talking)  # none of them was closed
            return deltas, transcript

    with serving(realtime, realtime_idle_s=IDLE_S) as (url, service):
        deltas, transcript = asyncio.run(scene(url, service))
    assert "".join(deltas) == transcript == stream_json_text(capsys, monkeypatch, realtime_slots_bundle, short)


def test_the_idle_limit_is_bounded_at_the_parser(capsys):
    args = build_parser().parse_args(["serve", "--bundle", "b"])
    args.env = Environment.read({})
    assert args.realtime_idle_s == 60.0 and ServeOptions.from_args(args).realtime_idle_s == 60.0
    assert build_parser().parse_args(["serve", "--bundle", "b", "--realtime-idle-s", "0.5"]).realtime_idle_s == 0.5
    for bad in ("0", "-1", "nan", "inf", "1e9"):
        assert "--realtime-idle-s" in parse_error(["serve", "--bundle", "b", "--realtime-idle-s", bad], capsys)


# ---------------------------------------------------------------- bad events: an error event, and on


def test_bad_events_get_error_events_and_the_connection_goes_on(live, realtime_slots_bundle, capsys, monkeypatch):
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
    assert "".join(deltas) == transcript == stream_json_text(capsys, monkeypatch, realtime_slots_bundle, short)


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
