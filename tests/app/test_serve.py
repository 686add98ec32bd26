"""`python -m runner serve` (runner/app/serve.py): a live server on loopback, spoken to by real clients (the
`openai` package, httpx, a raw socket), each answer checked against the CLI's own record of the same audio."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import soundfile as sf
import torch
from conftest import AUDIO
from live_server import running, serve_process

import runner
from runner.app import writers
from runner.app.cli import build_parser, main
from runner.app.options import Environment
from runner.app.serve import Service
from runner.app.serve_args import ServeOptions
from runner.audio import SAMPLE_RATE
from runner.bundle_name import bundle_name
from tests.families.test_long_audio import speech_with_gaps

NEW = 12  # tokens per answer: enough to tell files apart, quick on the tiny model
KEY = "sk-test-7f3a"
ROOT = Path(__file__).resolve().parents[2]
SPEECH = AUDIO / "speech.wav"
SHORT = AUDIO / "short.wav"


class Live:
    def __init__(self, url: str, service: Service):
        self.url, self.service = url, service

    def openai(self, key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=key, max_retries=0, http_client=httpx.Client(trust_env=False)
        )

    def post(self, data: bytes, name: str = "a.wav", key: str | None = None, **fields) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        with httpx.Client(trust_env=False, timeout=120) as c:
            return c.post(
                f"{self.url}/v1/audio/transcriptions", files={"file": (name, data)}, data=fields, headers=headers
            )


@contextlib.contextmanager
def serving(model, **options):
    """A Service on a free loopback port, uvicorn in a thread, as `serve` runs it in the main thread."""
    service = Service(model, ServeOptions(**{"port": 0, "max_new_tokens": NEW, **options}))
    with running(service) as port:
        yield Live(f"http://127.0.0.1:{port}", service)


def run_record(bundle: Path, audio: Path, new: int | None = NEW) -> dict:
    """`python -m runner run --json`'s record of one file (`new`: --max-new-tokens, None for run's default)."""
    out = io.StringIO()
    cap = ["--max-new-tokens", str(new)] if new is not None else []
    with contextlib.redirect_stdout(out):
        assert main(["run", "--bundle", str(bundle), "--audio", str(audio), "--json", *cap]) == 0
    (line,) = out.getvalue().splitlines()
    return json.loads(line)


@pytest.fixture(scope="module")
def records(tiny_bundle) -> dict:
    return {p.name: run_record(tiny_bundle, p) for p in (SPEECH, SHORT)}


@pytest.fixture(scope="module")
def model(tiny_bundle):
    with runner.load(tiny_bundle) as m:
        yield m


@pytest.fixture(scope="module")
def live(model):
    with serving(model) as s:
        yield s


def openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert "runner-audio-" not in error["message"] and "Traceback" not in error["message"]
    return error


# ---------------------------------------------------------------- the OpenAI client: every format


def test_every_response_format_says_what_run_json_says(live, records):
    client, record = live.openai(), records["speech.wav"]
    document = writers.transcript(record["text"], record["segments"], None)

    def create(fmt: str):
        with open(SPEECH, "rb") as f:
            return client.audio.transcriptions.create(model=live.service.model.name, file=f, response_format=fmt)

    j = create("json")
    assert record["text"] and j.text == record["text"]
    prompt, out = record["stats"]["prompt_tokens"], record["stats"]["generated_tokens"]
    assert (j.usage.type, j.usage.input_tokens, j.usage.output_tokens) == ("tokens", prompt, out) and out > 0
    assert j.usage.total_tokens == prompt + out
    assert create("text") == record["text"]
    assert create("srt") == writers.srt(document) and create("vtt") == writers.vtt(document)
    v = create("verbose_json")
    assert v.text == record["text"] and v.task == "transcribe" and v.duration == record["stats"]["audio_seconds"]
    got = [(s.start, s.end, s.text, s.tokens) for s in v.segments]
    assert got == [(s["start"], s["end"], s["text"], s["tokens"]) for s in record["segments"]]
    assert [s.id for s in v.segments] == list(range(len(got))) and all(s.temperature == 0.0 for s in v.segments)


def test_models_lists_the_bundle(live, tiny_bundle):
    (m,) = live.openai().models.list().data
    assert m.id == tiny_bundle.name == live.service.model.name and m.object == "model"


def test_health_and_metrics(live):
    with httpx.Client(trust_env=False) as c:
        assert c.get(f"{live.url}/health").json() == {"status": "ok"}
        text = c.get(f"{live.url}/metrics").text
    for name in (
        "runner_requests_total",
        "runner_request_seconds_bucket",
        "runner_generated_tokens_total",
        "runner_queue_depth",
        "runner_batch_occupancy_bucket",
    ):
        assert name in text, name
    assert 'runner_requests_total{route="/health",status="200"}' in text


def curl(url: str, *fields: str) -> tuple[int, str]:
    """curl's own multipart (`-F name=value`, `-F file=@path`) POSTed to the transcription route: (status, body)."""
    args = ["curl", "-sS", "--noproxy", "*", "--max-time", "120", "-w", "\n%{http_code}"]
    args += [a for f in fields for a in ("-F", f)]
    out = subprocess.run([*args, f"{url}/v1/audio/transcriptions"], capture_output=True, text=True, check=True)
    body, _, status = out.stdout.rpartition("\n")
    return int(status), body


def test_curl_multipart_gets_what_run_json_says(live, records):
    """The route as curl users call it: each format's answer is run --json's, and a request without a file is
    OpenAI's 400 error object naming the field."""
    record, name = records["speech.wav"], live.service.model.name
    document = writers.transcript(record["text"], record["segments"], None)
    status, body = curl(live.url, f"file=@{SPEECH}", f"model={name}")
    assert status == 200 and json.loads(body)["text"] == record["text"]
    assert curl(live.url, f"file=@{SPEECH}", "response_format=text") == (200, record["text"])
    assert curl(live.url, f"file=@{SPEECH};type=audio/wav", "response_format=srt") == (200, writers.srt(document))
    status, body = curl(live.url, f"model={name}", "response_format=json")
    assert status == 400 and json.loads(body)["error"]["param"] == "file", body


# ---------------------------------------------------------------- one program, many clients


def test_64_concurrent_requests_each_get_their_own_text(live, records):
    """64 clients at once, two files between them: every answer is `run`'s text for its file (p50/p99 printed)."""
    files = [(SHORT, records["short.wav"]["text"]), (SPEECH, records["speech.wav"]["text"])]

    def one(i) -> tuple[str, str, float]:
        path, want = files[i % 2]
        t0 = time.perf_counter()
        r = live.post(path.read_bytes(), name=path.name)
        assert r.status_code == 200, r.text
        return r.json()["text"], want, time.perf_counter() - t0

    with ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(one, range(64)))
    assert all(text == want for text, want, _ in answers)
    latency = sorted(s for _, _, s in answers)
    print(f"64 concurrent: p50 {latency[31]:.3f} s, p99 {latency[-1]:.3f} s")


def gate(model, monkeypatch) -> tuple[threading.Event, threading.Event]:
    """The engine's batches wait for `release` (set by the test) once `entered` says one began."""
    entered, release = threading.Event(), threading.Event()
    real = model.transcribe_feed

    def blocked(*args, **kwargs):
        entered.set()
        assert release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "transcribe_feed", blocked)
    return entered, release


def wait_queued(live: Live, n: int, pending: list) -> None:
    while live.service.engine.depth() < n:
        assert not any(f.done() for f in pending), [f.result().text for f in pending if f.done()]
        time.sleep(0.005)


def test_queued_requests_decode_together_and_a_bad_one_fails_alone(tiny_batch_bundle, monkeypatch):
    speech, short = SPEECH.read_bytes(), SHORT.read_bytes()
    with runner.load(tiny_batch_bundle) as model:
        want = {d: model.transcribe(d, max_new_tokens=NEW).text for d in (speech, short)}
        entered, release = gate(model, monkeypatch)
        with serving(model) as live, ThreadPoolExecutor(5) as pool:
            first = pool.submit(live.post, speech)
            assert entered.wait(60)
            queued = []
            for n, d in enumerate((short, speech, short, b"not audio" * 50), start=1):  # queued in this order
                queued.append(pool.submit(live.post, d))
                wait_queued(live, n, queued)
            release.set()
            answers = [f.result() for f in (first, *queued)]
            with httpx.Client(trust_env=False) as c:
                metrics = c.get(f"{live.url}/metrics").text
    assert [r.json()["text"] for r in answers[:4]] == [want[d] for d in (speech, short, speech, short)]
    assert openai_error(answers[4], 400)["param"] == "file"
    # occupancy as each joined: 1, 2, 3, 4 (the four fill the slots together); the bad one took a free slot once
    # they had finished (all 12 tokens at the same step) and was alone: 1
    assert "runner_batch_occupancy_count 5.0" in metrics and "runner_batch_occupancy_sum 11.0" in metrics


def test_a_request_joins_the_running_batch_and_answers_before_a_longer_one(tiny_batch_bundle, tmp_path, monkeypatch):
    """A 70 s file (two windows: 332 tokens at run's default cap) decoding; a short file sent once it has decoded
    10 steps takes a free slot of the same batch (128 tokens) and leaves it while the long one decodes on: the
    engine's steps go 1 row, 2 rows, 1 row again. Each answer is `run`'s text. (The order the client sees the two
    answers in is not asserted: on a loaded machine the server may flush both in one turn of its loop.)"""
    long_file = tmp_path / "long_70s.wav"
    sf.write(long_file, speech_with_gaps(70.0), SAMPLE_RATE, subtype="FLOAT")
    want = {p: run_record(tiny_batch_bundle, p, new=None)["text"] for p in (long_file, SHORT)}
    with runner.load(tiny_batch_bundle) as model:
        steps, decoding = [], threading.Event()
        decode = model._whole.engine.decode_batch

        def counted(tokens, *args):
            steps.append(tokens.shape[0])  # the rows decoding at this step
            if len(steps) == 10:
                decoding.set()
            return decode(tokens, *args)

        monkeypatch.setattr(model._whole.engine, "decode_batch", counted)

        def post(path: Path) -> str:
            r = live.post(path.read_bytes(), name=path.name)
            assert r.status_code == 200, r.text
            return r.json()["text"]

        with serving(model, max_new_tokens=None) as live, ThreadPoolExecutor(2) as pool:
            long = pool.submit(post, long_file)
            assert decoding.wait(120)
            short = pool.submit(post, SHORT)
            texts = {long_file: long.result(), SHORT: short.result()}
    assert texts == want
    # joined the running batch, and finished while the long one decoded on (a batch that waited to finish, or a
    # request queued until it did, would show no 2-row steps, or 2-row steps to the end)
    runs = [(rows, len(list(group))) for rows, group in itertools.groupby(steps)]
    assert [rows for rows, _ in runs] == [1, 2, 1], runs
    assert runs[0][1] >= 10 and runs[2][1] > 0


def test_a_full_queue_answers_429_and_the_rest_finish(model, monkeypatch, records):
    entered, release = gate(model, monkeypatch)
    data = SHORT.read_bytes()
    with serving(model, max_queue=1) as live, ThreadPoolExecutor(2) as pool:
        first = pool.submit(live.post, data)
        assert entered.wait(60)  # the engine holds the first
        second = pool.submit(live.post, data)
        wait_queued(live, 1, [second])  # the second waits in the queue
        busy = live.post(data)
        release.set()
        answers = [first.result(), second.result()]
    assert openai_error(busy, 429)["type"] == "rate_limit_error" and busy.headers["Retry-After"] == "1"
    assert [r.json()["text"] for r in answers] == [records["short.wav"]["text"]] * 2


def test_serve_help_imports_no_server_torch_or_numpy():
    code = (
        "import runpy, sys\n"
        "sys.argv = ['runner', 'serve', '--help']\n"
        "try:\n"
        "    runpy.run_module('runner', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0\n"
        "print(sorted(m for m in ('torch', 'numpy', 'starlette', 'uvicorn', 'prometheus_client') if m in sys.modules))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[-1] == "[]"


# ---------------------------------------------------------------- bad requests


def test_bad_uploads_are_openai_errors(live):
    assert openai_error(live.post(b""), 400)["param"] == "file"
    assert openai_error(live.post(b"not audio at all" * 40, name="x.wav"), 400)["param"] == "file"
    assert openai_error(live.post(SHORT.read_bytes(), response_format="docx"), 400)["param"] == "response_format"
    assert openai_error(live.post(SHORT.read_bytes(), temperature="hot"), 400)["param"] == "temperature"
    with httpx.Client(trust_env=False) as c:
        no_file = c.post(f"{live.url}/v1/audio/transcriptions", data={"model": live.service.model.name})
    assert openai_error(no_file, 400)["param"] == "file"


def test_unknown_model_and_word_times_on_voxtral_through_the_client(live):
    client = live.openai()
    with open(SHORT, "rb") as f, pytest.raises(openai.NotFoundError) as e:
        client.audio.transcriptions.create(model="whisper-1", file=f)
    assert e.value.body["code"] == "model_not_found"
    with open(SHORT, "rb") as f, pytest.raises(openai.BadRequestError) as e:
        client.audio.transcriptions.create(
            model=live.service.model.name, file=f, response_format="verbose_json", timestamp_granularities=["word"]
        )
    assert "word" in e.value.body["message"]


def test_the_key_guards_every_route_but_health(model, records):
    with serving(model, api_key=KEY) as live:
        with open(SHORT, "rb") as f, pytest.raises(openai.AuthenticationError):
            live.openai("sk-wrong").audio.transcriptions.create(model=model.name, file=f)
        with pytest.raises(openai.AuthenticationError):
            live.openai("sk-wrong").models.list()
        openai_error(live.post(SHORT.read_bytes()), 401)  # no key at all
        with httpx.Client(trust_env=False) as c:
            assert c.get(f"{live.url}/health").status_code == 200
            assert c.get(f"{live.url}/metrics").status_code == 401
            assert c.get(f"{live.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        with open(SHORT, "rb") as f:
            assert (
                live.openai(KEY).audio.transcriptions.create(model=model.name, file=f).text
                == records["short.wav"]["text"]
            )


def test_oversize_uploads_are_refused_with_or_without_a_length(model):
    body = SPEECH.read_bytes()
    with serving(model, max_upload_bytes=len(body) // 2) as live:
        assert openai_error(live.post(body), 413)["param"] == "file"  # by its Content-Length
        boundary = "b0undary"
        form = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n'.encode()
            + body
            + f"\r\n--{boundary}--\r\n".encode()
        )
        with httpx.Client(trust_env=False) as c:  # chunked: no length, refused as it arrives
            r = c.post(
                f"{live.url}/v1/audio/transcriptions",
                content=iter([form[i : i + 4096] for i in range(0, len(form), 4096)]),
                headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
            )
        openai_error(r, 413)
        assert live.post(SHORT.read_bytes()).status_code == 200


def test_a_client_gone_mid_upload_stalls_nobody(live, records):
    host, port = live.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(
            b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n"
            b"Content-Type: multipart/form-data; boundary=zz\r\n\r\n--zz\r\nContent-Disposition: form-data; "
            b'name="file"; filename="a.wav"\r\n\r\n' + SHORT.read_bytes()[:2000]
        )
    assert live.post(SHORT.read_bytes()).json()["text"] == records["short.wav"]["text"]


# ---------------------------------------------------------------- the verb


def test_serve_binds_loopback_by_default_and_reads_the_key_from_the_environment():
    args = build_parser().parse_args(["serve", "--bundle", "b"])
    assert (args.host, args.port, args.max_queue, args.max_upload_mb, args.api_key) == (
        "127.0.0.1",
        8000,
        64,
        200,
        None,
    )
    args.env = Environment.read({"VOXTRAL_RUNNER_API_KEY": KEY})
    options = ServeOptions.from_args(args)
    assert options.api_key == KEY and KEY not in repr(options) and KEY not in repr(args.env)
    args.api_key = "flag"
    assert ServeOptions.from_args(args).api_key == "flag"


def test_a_batch_the_bundle_cannot_decode_is_one_error_line(tiny_bundle, capsys):
    assert main(["serve", "--bundle", str(tiny_bundle), "--port", "0", "--max-batch", "4"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: --max-batch 4:"), err


def test_sigterm_drains_the_request_in_flight_and_exits_0(tiny_bundle, tmp_path, records):
    env = {"TMPDIR": str(tmp_path), "VOXTRAL_RUNNER_API_KEY": KEY}
    p, port, line = serve_process(tiny_bundle, "--max-new-tokens", str(NEW), env=env)
    try:
        body = SHORT.read_bytes()
        head = b'--zz\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n'
        tail = b"\r\n--zz--\r\n"
        with socket.create_connection(("127.0.0.1", port)) as s:
            # 100-continue: the server answers it once the handler reads the body, so the request is in flight
            s.sendall(
                f"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                f"Content-Type: multipart/form-data; boundary=zz\r\nExpect: 100-continue\r\nContent-Length: "
                f"{len(head) + len(body) + len(tail)}\r\n\r\n".encode()
            )
            assert _read_head(s).startswith(b"HTTP/1.1 100")
            p.send_signal(signal.SIGTERM)
            while _accepts(port):  # the server stopped listening: it is shutting down
                time.sleep(0.01)
            s.sendall(head + body + tail)
            answer = _read_response(s)
        assert p.wait(60) == 0
    finally:
        if p.poll() is None:
            p.kill()
    assert answer.startswith(b"HTTP/1.1 200")
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["text"] == records["short.wav"]["text"]
    rest = p.stderr.read()
    assert KEY not in line + rest and "Traceback" not in rest and "error" not in rest.lower()
    assert list(tmp_path.iterdir()) == []  # the private temporary folder is gone


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def _read_head(s: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\r\n\r\n"):
        chunk = s.recv(1)
        assert chunk, data
        data += chunk
    return data


def _read_response(s: socket.socket) -> bytes:
    data = b""
    while chunk := s.recv(65536):
        data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = re.search(rb"content-length: (\d+)", head, re.I)
        if length and len(body) >= int(length.group(1)):
            break
    return data


# ---------------------------------------------------------------- the README's example


def test_the_readme_server_example_runs_as_written(live, records):
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Server") :]
    e2e_bundle = bundle_name("tiny", "cpu", "fp32", torch.__version__)  # the bundle `nox -s e2e` builds
    assert f"python -m runner serve --bundle artifacts/{e2e_bundle}" in section
    code = section[section.index("```python\n") + 10 : section.index("```\n", section.index("```python\n") + 10)]
    assert (
        len([line for line in code.splitlines() if line.strip()]) == 4
        and "http://127.0.0.1:8000/v1" in code
        and f'"{e2e_bundle}"' in code  # the model's name is its directory's
    )
    code = code.replace("http://127.0.0.1:8000", live.url).replace(f'"{e2e_bundle}"', repr(live.service.model.name))
    env = {k: v for k, v in os.environ.items() if "PROXY" not in k.upper() and not k.startswith("OPENAI_")}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == records["speech.wav"]["text"].strip()
