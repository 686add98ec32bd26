"""A Service (runner/app/serve.py) on a free loopback port, uvicorn in a thread as `serve` runs it in the main
thread: what the server's tests talk to with real clients; and `python -m runner serve` as a process."""

from __future__ import annotations

import contextlib
import os
import re
import selectors
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from runner.app.serve import Service, _listen


@contextlib.contextmanager
def running(service: Service) -> Iterator[int]:
    """The service listening on 127.0.0.1; yields its port. Stops the server and closes the service after."""
    import uvicorn

    sock = _listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(service.app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive(), "the server did not start"
            time.sleep(0.01)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        service.close()
        sock.close()


ROOT = Path(__file__).resolve().parents[2]


def serve_process(bundle: Path, *args: str, env: dict | None = None, start_s: float = 120) -> tuple:
    """`python -m runner serve --bundle BUNDLE --port 0 ARGS` started (no proxy settings: it is on loopback), and
    the port it says on its first stderr line: (the process, its port, that line). The caller stops it."""
    clean = {k: v for k, v in os.environ.items() if "PROXY" not in k.upper()}
    cmd = [sys.executable, "-m", "runner", "serve", "--bundle", str(bundle), "--port", "0", *args]
    p = subprocess.Popen(cmd, cwd=ROOT, env={**clean, **(env or {})}, stderr=subprocess.PIPE, text=True)
    with selectors.DefaultSelector() as sel:
        sel.register(p.stderr, selectors.EVENT_READ)
        if not sel.select(start_s):
            p.kill()
            raise AssertionError(f"no line from `serve` in {start_s} s")
    line = p.stderr.readline()
    found = re.search(r"on http://127\.0\.0\.1:(\d+) ", line)
    assert found, line
    return p, int(found.group(1)), line
