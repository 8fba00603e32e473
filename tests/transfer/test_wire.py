"""Framing over a real socket pair."""

import socket

import pytest

from streamrl.transfer.manifest import TransferError
from streamrl.transfer.planes import RateLimiter, send_limited
from streamrl.transfer.wire import recv_exact, recv_json, send_error, send_json

pytestmark = [pytest.mark.unit]


def test_frames_roundtrip_and_errors_surface():
  a, b = socket.socketpair()
  with a, b:
    send_json(a, {"op": "get", "want": 3})
    assert recv_json(b) == {"op": "get", "want": 3}
    send_limited(a, memoryview(b"x" * 1000), [RateLimiter(1e12)])
    assert bytes(recv_exact(b, 1000)) == b"x" * 1000
    send_error(a, "chunk 3 is corrupted")
    with pytest.raises(TransferError, match="chunk 3 is corrupted"):
      recv_json(b)
    a.close()
    with pytest.raises(TransferError, match="closed"):
      recv_json(b)
