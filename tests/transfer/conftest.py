"""Small tensors, tiny chunks and a cluster fixture that closes every node it made."""

import threading
import time

import ml_dtypes
import numpy as np
import pytest

from streamrl.transfer import Publisher, Receiver, Transfer, new_secret

NAMES = [
    "model.embed_tokens.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.0.self_attn.q_proj.bias",
    "model.norm.weight",
]


def make_tensors(seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  return {
      NAMES[0]: rng.standard_normal((64, 32)).astype(ml_dtypes.bfloat16),
      NAMES[1]: rng.standard_normal((32, 48)).astype(ml_dtypes.bfloat16),
      NAMES[2]: rng.standard_normal(32).astype(np.float32),
      NAMES[3]: rng.standard_normal(32).astype(np.float32),
  }  # ~7.5 KB: 8 chunks of 1 KiB


def wait_until(pred, timeout=10.0) -> bool:
  """Polls `pred` until it holds (True) or `timeout` seconds pass (False)."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if pred():
      return True
    time.sleep(0.01)
  return False


def same(a: dict, b: dict) -> bool:
  return set(a) == set(b) and all(
      a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes()
      for k in a
  )


class Loads:
  """A load_fn that records (version, copied tensors) per call."""

  def __init__(self):
    self.calls = []
    self.lock = threading.Lock()

  def __call__(self, tensors, version):
    with self.lock:
      self.calls.append((version, {k: np.array(v) for k, v in tensors.items()}))

  @property
  def versions(self):
    return [v for v, _ in self.calls]


class Cluster:
  """Nodes that share one run secret (``self.secret``) and the first publisher's keys
  (``self.run_keys``) unless a test passes others."""

  def __init__(self):
    self.nodes = []
    self.secret = new_secret()
    self.run_keys = None

  def publisher(self, dc="A", host="trainer", bind="127.0.0.1", secret=None, **cfg):
    secret = self.secret if secret is None else secret
    p = Publisher(config(**cfg), dc=dc, host=host, bind=bind, secret=secret)
    self.nodes.append(p)
    if self.run_keys is None:
      self.run_keys = p.run_keys
    return p

  def receiver(
      self,
      name,
      dc="A",
      host=None,
      schema=None,
      join=None,
      bind="127.0.0.1",
      secret=None,
      run_keys=None,
      **cfg,
  ):
    loads = Loads()
    r = Receiver(
        name,
        dc,
        loads,
        schema,
        config=config(**cfg),
        host=host or f"host-{name}",
        bind=bind,
        secret=self.secret if secret is None else secret,
        run_keys=self.run_keys if run_keys is None else run_keys,
    )
    r.loads = loads
    self.nodes.append(r)
    if join is not None:
      r.join(join.address, timeout=10)
    return r

  def close(self):
    for n in self.nodes:
      n.close()


def config(**overrides) -> Transfer:
  base = dict(
      chunk_bytes=1024,
      fanout=2,
      max_retries=2,
      io_timeout_s=5.0,
      connect_timeout_s=1.0,
      repair_interval_s=60.0,
  )
  base.update(overrides)
  return Transfer(**base)


@pytest.fixture
def cluster():
  c = Cluster()
  yield c
  c.close()
