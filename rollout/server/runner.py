"""Running the app: a uvicorn server on its own thread of the caller's process."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import socket
import threading
from collections.abc import Callable

import uvicorn

from .app import build_app
from .backend import Backend, WorkerBackend
from .config import ServerConfig
from .connection import HeadDeadlineProtocol

logger = logging.getLogger(__name__)


class Server:
    """An HTTP server running on a thread of this process; ``close()`` drains and stops it.

    Several servers may run in one process, each on its own port, over the same worker or
    over different ones.
    """

    def __init__(self, backend: Backend, config: ServerConfig):
        self.config = config
        self.backend = backend
        # Bound here, so a port in use fails in the caller and port 0 is known at once.
        self._socket = socket.create_server((config.host, config.port))
        self.port = self._socket.getsockname()[1]
        app = build_app(backend, config)
        self._closers = app.state.closers
        self._begin_drain = app.state.begin_drain
        self._loop: asyncio.AbstractEventLoop | None = None  # the server thread's, once it runs
        uvicorn_config = uvicorn.Config(
            app,
            log_config=None,
            access_log=False,  # the app logs one line per request itself
            timeout_graceful_shutdown=config.drain_timeout_s,
            # Longer than clients keep idle connections (httpx: 5 s), so a client never sends a
            # request on a connection the server is closing (seen: ReadError at 5 s, uvicorn's default).
            timeout_keep_alive=config.keep_alive_s,
            lifespan="off",
            # h11, pinned: "auto" takes httptools wherever it is installed, whose connections
            # would have no deadline on a request's head.
            http=functools.partial(HeadDeadlineProtocol, header_timeout_s=config.header_timeout_s),
        )
        self._uvicorn = uvicorn.Server(uvicorn_config)
        self._thread = threading.Thread(target=self._run, name=f"rollout-server-{self.port}", daemon=True)
        self._failed: BaseException | None = None
        self._thread.start()
        while not self._uvicorn.started and self._thread.is_alive():
            self._thread.join(timeout=0.01)
        if not self._uvicorn.started:
            self._socket.close()
            raise RuntimeError(f"the HTTP server on {self.url} did not start: {self._failed}")
        path = getattr(backend, "model_path", None)  # optional for backends written before it
        source = f" (from {path})" if path else ""
        logger.info("serving model '%s'%s on %s", app.state.model_name, source, self.url)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported by __init__ (start-up) or close()
            self._failed = exc

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self._uvicorn.serve(sockets=[self._socket])

    @property
    def url(self) -> str:
        host = self.config.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        """Stop accepting connections, let running requests finish (up to ``drain_timeout_s``),
        and join the server thread. The worker is left running. Idempotent."""
        if not self._thread.is_alive():
            return
        # Requests still waiting for their bodies are answered at once: no work of theirs began.
        with contextlib.suppress(RuntimeError):  # the loop closed since: nothing is left to answer
            self._loop.call_soon_threadsafe(self._begin_drain)
        self._uvicorn.should_exit = True
        self._thread.join(timeout=self.config.drain_timeout_s + 30)
        if self._thread.is_alive():
            logger.warning("HTTP server thread on %s did not stop", self.url)
        for close in self._closers:
            close()
        self._socket.close()
        logger.info("stopped serving on %s", self.url)

    def wait(self, then: Callable[[], None] | None = None) -> None:
        """Block until SIGINT or SIGTERM, then :meth:`close` and ``then()`` (main thread only;
        e.g. the worker's ``close``). While they run, another SIGTERM (a supervisor repeating
        itself) is let be; another SIGINT (Ctrl-C again) stops at once."""
        stop = threading.Event()
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            while not stop.wait(0.5) and self.running:
                pass
        finally:
            # Python's own Ctrl-C, whatever SIGINT did before: a server started in the background
            # of a shell inherits SIGINT ignored, and the drain could then not be cut short.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            try:  # from here a KeyboardInterrupt may come at any line
                signal.signal(signal.SIGTERM, lambda *_: logger.info("SIGTERM while draining: the drain goes on"))
                logger.info("draining running requests (up to %s s) on %s", self.config.drain_timeout_s, self.url)
                try:
                    self.close()
                finally:
                    if then is not None:
                        then()
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_server(worker, config: ServerConfig | None = None) -> Server:
    """Serve a :class:`rollout.RolloutWorker` over HTTP (``Server(backend, config)`` serves any
    other :class:`Backend`)."""
    return Server(WorkerBackend(worker), config or ServerConfig())
