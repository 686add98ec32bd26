"""`serve` replicas share nothing: two `python -m runner serve` processes on one bundle, behind a round robin, each
answer what one server answers, each count only their own requests, and one killed leaves the other serving, its
/health the load balancer's signal to route around the dead one (docs/scale.md, "Serving replicas")."""

from __future__ import annotations

import contextlib
import itertools
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from conftest import AUDIO
from live_server import running, serve_process
from prometheus_client.parser import text_string_to_metric_families

import runner
from runner.app.serve import Service
from runner.app.serve_args import ServeOptions

ROOT = Path(__file__).resolve().parents[2]
NEW = 12  # tokens per answer: enough to tell files apart, quick on the tiny model
FILES = [AUDIO / "speech.wav", AUDIO / "short.wav", AUDIO / "silence.wav"]  # three: each replica gets each
N = 12  # requests through the round robin: an even share each
ROUTE = "/v1/audio/transcriptions"
START_S = 120


class RoundRobin(httpx.BaseTransport):
    """The trivial load balancer: each request to the next healthy replica in turn. `check` is its health check:
    a replica whose /health does not answer 200 leaves the rotation."""

    def __init__(self, ports: list[int]):
        self.ports, self.inner = list(ports), httpx.HTTPTransport()
        self._turn = itertools.cycle(self.ports)

    def check(self) -> None:
        self.ports = [p for p in self.ports if healthy(p)]
        self._turn = itertools.cycle(self.ports)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.url = request.url.copy_with(host="127.0.0.1", port=next(self._turn))
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


def healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5, trust_env=False).status_code == 200
    except httpx.TransportError:  # nothing listens: a dead replica
        return False


def client(base_url: str, transport: httpx.BaseTransport | None = None) -> openai.OpenAI:
    http = httpx.Client(transport=transport, trust_env=False, timeout=120)
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, http_client=http)


def transcribe(c: openai.OpenAI, model: str, path: Path) -> str:
    with open(path, "rb") as f:
        return c.audio.transcriptions.create(model=model, file=f).text


def served(port: int) -> float:
    """The replica's own count of transcriptions answered 200, from its /metrics as a scraper parses them."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5, trust_env=False).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "runner_requests_total" and s.labels == {"route": ROUTE, "status": "200"}:
                return s.value
    return 0.0


@contextlib.contextmanager
def replicas(bundle: Path, n: int) -> Iterator[list[tuple[subprocess.Popen, int]]]:
    """N `serve` processes on free loopback ports."""
    started = []
    try:
        for _ in range(n):
            p, port, _ = serve_process(bundle, "--max-new-tokens", str(NEW), start_s=START_S)
            started.append((p, port))
        yield started
    finally:
        for p, _ in started:
            if p.poll() is None:
                p.terminate()
        for p, _ in started:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.stderr.close()


@pytest.fixture(scope="module")
def single(tiny_bundle) -> dict[str, str]:
    """One server's answer for each file: the reference the replicas must each give."""
    with runner.load(tiny_bundle) as model, running(Service(model, ServeOptions(port=0, max_new_tokens=NEW))) as port:
        with client(f"http://127.0.0.1:{port}") as c:
            return {p.name: transcribe(c, model.name, p) for p in FILES}


def test_two_replicas_behind_a_round_robin_share_nothing(tiny_bundle, single):
    assert len(set(single.values())) == len(FILES) and all(single.values())  # the files tell apart
    with replicas(tiny_bundle, 2) as started:
        (a, port_a), (b, port_b) = started
        assert healthy(port_a) and healthy(port_b)
        balancer = RoundRobin([port_a, port_b])
        c = client("http://balancer", balancer)  # every request goes where the round robin sends it
        for i in range(N):
            path = FILES[i % len(FILES)]
            assert transcribe(c, tiny_bundle.name, path) == single[path.name], path.name
        # each counts its own requests only, and together they are all: nothing is shared, not even metrics
        assert (served(port_a), served(port_b)) == (N / 2, N / 2)

        a.kill()  # a replica lost: a crash, a node gone
        a.wait(60)
        assert not healthy(port_a), "a dead replica's /health cannot connect"
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port_a}/health", timeout=5, trust_env=False)
        balancer.check()
        assert balancer.ports == [port_b]
        for i in range(N):
            path = FILES[i % len(FILES)]
            assert transcribe(c, tiny_bundle.name, path) == single[path.name], path.name
        assert served(port_b) == N / 2 + N
        c.close()
        b.terminate()
        assert b.wait(60) == 0
        rest = b.stderr.read()
        assert "Traceback" not in rest and "error" not in rest.lower(), rest[-2000:]
