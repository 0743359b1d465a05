"""An HTTP server in a thread of this process, on a free port of 127.0.0.1 (benchmarks that must reach the
engine client's internals, such as chaos injection, and tests)."""
from __future__ import annotations

import contextlib
import socket
import threading
import time


@contextlib.contextmanager
def serve_in_thread(app, start_timeout_s: float = 60.0):
    """Yields the server's base URL (http://127.0.0.1:PORT) while uvicorn serves `app` in a daemon thread."""
    import uvicorn

    sock = socket.socket()  # bound here and handed to uvicorn: no other process can take the port meanwhile
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        end = time.monotonic() + start_timeout_s
        while not server.started and thread.is_alive() and time.monotonic() < end:
            time.sleep(0.01)
        if not server.started:
            raise RuntimeError("the in-process server did not start")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
