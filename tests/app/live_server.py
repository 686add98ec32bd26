"""A Service (runner/app/serve.py) on a free loopback port, uvicorn in a thread as `serve` runs it in the main
thread: what the server's tests talk to with real clients."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

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
