"""HTTP server mode: OpenAI-compatible generation and admin routes over a rollout worker.

Runs in the worker's process (``worker.serve(...)``, or ``python -m rollout.serve``) so a
trainer can keep syncing weights while external agents call the server. Never imports sgl_jax.
"""

from .backend import Backend, WorkerBackend
from .config import ServerConfig
from .runner import Server, start_server

__all__ = ["Backend", "Server", "ServerConfig", "WorkerBackend", "start_server"]
