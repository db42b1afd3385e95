"""The server's HTTP/1.1 connections: uvicorn's h11 protocol with a deadline on each request's head."""

from __future__ import annotations

import asyncio
import json
import logging

import h11  # uvicorn's own dependency
from uvicorn.protocols.http.h11_impl import H11Protocol

from .protocol import ApiError

logger = logging.getLogger(__name__)


class HeadDeadlineProtocol(H11Protocol):
    """Closes a connection whose request head (request line and headers) has not arrived whole
    ``header_timeout_s`` after the connection opened, or after the first byte of a later request
    on it (the keep-alive timeout governs the silence between requests). A body the app answered
    without reading (a 404, a 401), and the head after it, are held to the same deadline.

    uvicorn times neither: its keep-alive timer starts after a response and stops at the next
    byte, so a client that sent nothing, or trickled header bytes, held its connection (and a
    file descriptor) until shutdown. A deadline, not reset by each byte. A partial head is
    answered a 408; a connection that sent nothing is closed, as an idle keep-alive one is.
    """

    def __init__(self, *args, header_timeout_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._time_the_next_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # Judged after the bytes are taken: they may end a body the app answered early (a 401
        # before reading it), and h11 then starts the next cycle here, where uvicorn has just
        # cancelled its keep-alive timer: the next head's deadline starts now.
        super().data_received(data)
        self._time_the_next_head()

    def on_response_complete(self) -> None:
        # A head already started behind this response (pipelined), or a body still coming that
        # the app answered without reading, is timed from here.
        super().on_response_complete()
        if self.conn.trailing_data[0] or self.conn.their_state is h11.SEND_BODY:
            self._time_the_next_head()

    def _time_the_next_head(self) -> None:
        # The client's side is IDLE only before a head is whole (a new connection's, timed from
        # its opening, or the next request's); SEND_BODY after the answer is a body no one reads,
        # which uvicorn's keep-alive timer stops timing at its next byte.
        answered_body = self.conn.our_state is h11.DONE and self.conn.their_state is h11.SEND_BODY
        if self.conn.their_state is not h11.IDLE and not answered_body:
            self._cancel_deadline()
        elif self._head_deadline is None and not self.transport.is_closing():
            self._head_deadline = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _cancel_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:  # part of a head: it may read
            message = (
                f"the request head (request line and headers) did not arrive whole within "
                f"{self.header_timeout_s} s (ServerConfig.header_timeout_s)"
            )
            body = json.dumps(ApiError(408, message, code="request_timeout").body()).encode()
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                + f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode()
                + body
            )
            client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
            logger.info("%s: 408, its request head did not arrive within %s s", client, self.header_timeout_s)
        self.transport.close()
