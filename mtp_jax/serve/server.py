"""The app under uvicorn, on a socket bound before the model loads (a port in use is refused at once, and
`--port 0` gets a free one), with SIGTERM (or Ctrl-C) a graceful stop that ends the process with status 0.

At SIGTERM (uvicorn's own handling): the listening socket closes, idle connections close, requests in flight finish
(those past the grace period are cancelled, freeing their slots), then the app's shutdown stops the engine's thread.
uvicorn re-raises a signal it caught once it is done, which would end the process by SIGTERM (status 143): here the
signal is taken as the request to stop, and not re-raised. A second one stops waiting for requests in flight.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

import uvicorn

from mtp_jax.runtime.errors import UserError


class Server(uvicorn.Server):
    """uvicorn's server; `on_ready()` once it listens, `on_stop()` at a signal to stop (before uvicorn's handling)."""

    def __init__(self, config: uvicorn.Config, *, on_ready: Callable[[], None], on_stop: Callable[[], None]):
        super().__init__(config)
        self.on_ready, self.on_stop = on_ready, on_stop

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and not self.should_exit:
            self.on_ready()

    def handle_exit(self, sig: int, frame) -> None:
        self.on_stop()
        self.force_exit = self.should_exit  # the second signal: stop waiting
        self.should_exit = True


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (not listening yet: uvicorn listens on it), or one line saying why not."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]  # fmt: skip
    except (socket.gaierror, UnicodeError) as e:
        raise UserError(f"--host {host}: {getattr(e, 'strerror', None) or e}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
