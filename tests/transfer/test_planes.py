"""Token-bucket pacing of an emulated link, on a fake clock."""

import pytest

from streamrl.transfer.planes import RateLimiter

pytestmark = [pytest.mark.unit]


class FakeClock:

  def __init__(self):
    self.t = 0.0

  def __call__(self):
    return self.t

  def sleep(self, dt):
    self.t += dt


def test_token_bucket_paces_to_the_rate_after_the_burst():
  clock = FakeClock()
  lim = RateLimiter(1000.0, burst=100, clock=clock, sleep=clock.sleep)
  assert lim.consume(100) == 0.0  # the burst goes out at once
  for _ in range(10):
    lim.consume(100)
  assert clock.t == pytest.approx(1.0)  # 1000 bytes more at 1000 B/s
  clock.t += 5.0  # idle: credit is capped at one burst
  lim.consume(100)
  assert lim.consume(100) == pytest.approx(0.1)


def test_two_streams_share_one_link():
  clock = FakeClock()
  lim = RateLimiter(1000.0, burst=0, clock=clock, sleep=clock.sleep)
  for _ in range(5):
    lim.consume(100)  # stream 1
    lim.consume(100)  # stream 2
  assert clock.t == pytest.approx(1.0)
