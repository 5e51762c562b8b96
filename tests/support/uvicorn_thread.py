"""An ASGI app served by uvicorn on a free loopback port in a daemon thread, for as long as a ``with`` lasts."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from worker.run.procs import free_port


@contextmanager
def serve(app: Any, start_timeout_s: float = 20.0) -> Iterator[str]:
    """Yield the base URL (``http://127.0.0.1:<port>``) once uvicorn serves ``app``; stop it on exit (10 s join)."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
