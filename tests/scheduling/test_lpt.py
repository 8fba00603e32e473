import numpy as np
import pytest

from streamrl.scheduling.lpt import AdmissionQueue, lpt_order

pytestmark = [pytest.mark.unit]


def test_lpt_order_longest_first_and_stable():
  assert lpt_order([3, 9, 1, 9, 5]) == [1, 3, 4, 0, 2]
  assert lpt_order([2, 2, 2]) == [0, 1, 2]
  assert lpt_order([]) == []
  with pytest.raises(ValueError, match="NaN"):
    lpt_order([1.0, float("nan")])


@pytest.mark.parametrize("seed", range(20))
def test_admission_order_and_cap_under_random_finishes(seed):
  rng = np.random.default_rng(seed)
  n, cap = int(rng.integers(1, 40)), int(rng.integers(1, 8))
  order = lpt_order(rng.integers(1, 100, size=n))
  q = AdmissionQueue(order, max_in_flight=cap)
  admitted = list(q.admit())
  assert len(q.in_flight) == min(cap, n)
  while not q.done:
    running = sorted(q.in_flight)
    q.finish(running[int(rng.integers(len(running)))])
    admitted += q.admit()
    assert len(q.in_flight) <= cap
    # Slots are refilled at once whenever work is pending.
    assert len(q.in_flight) == cap or q.num_pending == 0
  assert admitted == order
  assert sorted(q.finished) == sorted(order)


def test_admission_queue_misuse():
  q = AdmissionQueue([0, 1], max_in_flight=1)
  assert q.admit() == [0]
  assert q.admit() == []
  with pytest.raises(ValueError, match="not in flight"):
    q.finish(1)
  with pytest.raises(ValueError, match=">= 1"):
    AdmissionQueue([0], max_in_flight=0)
  with pytest.raises(ValueError, match="duplicate"):
    AdmissionQueue([0, 0], max_in_flight=1)


def test_lpt_order_is_the_stable_sort_longest_first_with_ties_and_infinities():
  rng = np.random.default_rng(0)
  for _ in range(50):
    x = rng.integers(0, 5, size=int(rng.integers(0, 40))).astype(float)
    x[rng.random(x.size) < 0.1] = np.inf
    want = sorted(range(x.size), key=lambda i: -x[i])
    assert lpt_order(x) == want and lpt_order(list(x)) == want
