"""Run the API with uvicorn until SIGINT or SIGTERM."""
from __future__ import annotations

import ipaddress
import signal
import socket
import sys
import threading

import uvicorn

from ..errors import MiniRunError
from .app import MAX_BODY, create_app
from .worker import EngineWorker


class Server(uvicorn.Server):
    """uvicorn's server whose SIGINT/SIGTERM handler first stops the engine's work: uvicorn waits
    for open responses before it exits, and an answer streaming (or a 16K-token prefill) would
    hold it that long. Stopped this way, the process exits normally instead of re-raising the
    signal after the shutdown."""

    def __init__(self, config: uvicorn.Config, worker: EngineWorker):
        super().__init__(config)
        self.worker = worker

    def handle_exit(self, sig, frame) -> None:
        self.worker.stop()
        super().handle_exit(sig, frame)
        getattr(self, "_captured_signals", []).clear()


def make_server(engine, model_name: str, host: str = "127.0.0.1", port: int = 8080, api_key: str | None = None,
                max_queue: int = 16, log_level: str = "info", start_worker: bool = True,
                max_body: int = MAX_BODY, parallel: int | None = None) -> Server:
    """A server over `engine` and parallel - 1 siblings (default: its config's; its worker's thread started, unless
    start_worker is False: then the caller runs server.worker.run()); .run() serves until stopped."""
    worker = EngineWorker(engine, max_queue, parallel)
    if start_worker:
        worker.start()
    app = create_app(worker, model_name, api_key, max_body)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                            timeout_graceful_shutdown=5)
    return Server(config, worker)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (port 0: a free one), or a one-line MiniRunError."""
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise MiniRunError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def run(engine, model_name: str, sock: socket.socket, api_key: str | None, max_queue: int,
        max_body: int = MAX_BODY) -> None:
    """Serve on `sock` (from bind) until SIGINT or SIGTERM. The engine's work runs in this thread,
    the one that loaded it, and HTTP in another: torch's and Numba's OpenMP thread pools belong to
    the thread that first ran parallel work, and a second thread running the kernels got pools of
    its own that competed with the first's (a follow-up question's prefill took 1.2 s instead of
    0.5 on 2 cores)."""
    host, port = sock.getsockname()[:2]
    where = f"[{host}]" if ":" in host else host
    server = make_server(engine, model_name, host, port, api_key, max_queue, start_worker=False,
                         max_body=max_body)
    server.worker.warm_up()
    if not is_loopback(host) and not api_key:
        print(f"minirun serve: note: listening on {host} without --api-key: anyone who can reach this port can "
              "use the model", file=sys.stderr)
    print(f"minirun serve: {model_name} (ctx {engine.config.ctx}, kv {engine.config.kv}, {engine.config.parallel} at once) on "
          f"http://{where}:{port}/ "
          f"(the chat page; the API at /v1; Ctrl-C stops)", file=sys.stderr)
    http = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="minirun-http", daemon=True)
    for sig in (signal.SIGINT, signal.SIGTERM):   # (uvicorn listens to signals only from the main thread)
        signal.signal(sig, server.handle_exit)
    http.start()
    try:
        server.worker.run(alive=http.is_alive)
    finally:
        server.worker.stop()
        server.should_exit = True
        http.join(timeout=10)
    print("minirun serve: stopped", file=sys.stderr)
