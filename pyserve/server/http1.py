"""The HTTP protocol uvicorn runs for pyserve: HTTP/1.1, refusing HTTP/2 properly.

Clients that probe for a gRPC (HTTP/2 prior-knowledge) server, as sglang-router does when it
first meets a worker, open the connection with the HTTP/2 preface. uvicorn's HTTP/1 parser
would log "Invalid HTTP request received" and answer a 400 in HTTP/1. Here the connection is
answered in HTTP/2's own terms instead: an empty SETTINGS frame (the server preface) and a
GOAWAY with error code HTTP_1_1_REQUIRED (RFC 9113 sections 3.4, 6.8 and 7), then closed, so
the client learns at once to use HTTP/1.1. Everything else goes to uvicorn's protocol as is.
"""

from __future__ import annotations

import logging
import struct

from uvicorn.protocols.http.auto import AutoHTTPProtocol

logger = logging.getLogger(__name__)

HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_SETTINGS, _GOAWAY = 0x4, 0x7
HTTP_1_1_REQUIRED = 0xD
_GOAWAY_DEBUG = b"pyserve speaks HTTP/1.1"


def _frame(frame_type: int, payload: bytes) -> bytes:
    """One HTTP/2 frame on stream 0: 24-bit length, type, flags 0, stream id 0."""
    return struct.pack(">I", len(payload))[1:] + bytes([frame_type, 0]) + b"\0\0\0\0" + payload


REFUSAL = _frame(_SETTINGS, b"") + _frame(_GOAWAY, struct.pack(">II", 0, HTTP_1_1_REQUIRED) + _GOAWAY_DEBUG)


class HTTP1Protocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    """uvicorn's HTTP/1.1 protocol (httptools or h11, whichever uvicorn picks) that answers
    an HTTP/2 preface with SETTINGS + GOAWAY(HTTP_1_1_REQUIRED) instead of a parse error."""

    _head = b""
    _sniffed = False

    def data_received(self, data: bytes) -> None:
        if not self._sniffed:
            head = self._head + data
            if len(head) < len(HTTP2_PREFACE) and HTTP2_PREFACE.startswith(head):
                self._head = head  # could still be the preface: wait for more bytes
                return
            self._sniffed, self._head = True, b""
            if head.startswith(HTTP2_PREFACE):
                logger.debug("refused an HTTP/2 connection from %s (HTTP/1.1 only)", self.client)
                self.transport.write(REFUSAL)
                self.transport.close()
                return
            data = head
        super().data_received(data)
