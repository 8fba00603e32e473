"""The random model with Qwen2-0.5B's shapes that bench_generator.py updates, and
a sampler of peak memory.

`big_config(layers)` is Qwen2-0.5B's shapes with `layers` layers,
`random_model` fills it with N(0, 0.02) weights drawn by numpy, and
`build_big_dir` writes it once as an HF directory with the char tokenizer.
`PeakMemory` samples the summed RSS of this process and its children.
"""

import os
import time


def available_gib() -> float:
  import psutil  # pylint: disable=g-import-not-at-top

  return psutil.virtual_memory().available / 2**30


class PeakMemory:
  """Samples the summed RSS of this process and its children (the engine
  processes) in a thread; `peak_gib` after the block. RSS counts shared pages
  once per process, so this is an upper bound."""

  def __init__(self, period_s: float = 0.1):
    self.period_s, self.peak_gib, self.base_gib = period_s, 0.0, None

  def _sample(self):
    import psutil  # pylint: disable=g-import-not-at-top

    me = psutil.Process()
    while not self._stop.is_set():
      total = 0
      for p in [me] + me.children(recursive=True):
        try:
          total += p.memory_info().rss
        except psutil.Error:
          pass
      if self.base_gib is None:
        self.base_gib = total / 2**30
      self.peak_gib = max(self.peak_gib, total / 2**30)
      self._stop.wait(self.period_s)

  def __enter__(self):
    import threading  # pylint: disable=g-import-not-at-top

    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._sample, daemon=True)
    self._thread.start()
    while self.base_gib is None:
      time.sleep(0.01)
    return self

  @property
  def extra_gib(self) -> float:
    return self.peak_gib - self.base_gib

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()


def big_config(num_layers: int):
  """Qwen2-0.5B's shapes (tied embeddings, q/k/v bias, vocab 151936) with
  `num_layers` layers and positions up to 512."""
  import dataclasses  # pylint: disable=g-import-not-at-top

  from experiments import trainer_workload  # pylint: disable=g-import-not-at-top

  cfg = trainer_workload.model_config("qwen2_0_5b", num_layers)
  return dataclasses.replace(cfg, max_position_embeddings=512)


def random_model(cfg, seed: int):
  """A Transformer with N(0, 0.02) weights drawn by numpy (JAX's threefry on
  two cores is much slower for 0.5B numbers); norms 1, biases 0, as the init."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from streamrl.models.transformer import Transformer  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(seed)
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)

  def fill(path, leaf):
    name = str(path[-1].key if hasattr(path[-1], "key") else path[-1])
    if name == "scale":
      return jnp.ones(leaf.shape, leaf.dtype)
    if name.startswith("b_"):
      return jnp.zeros(leaf.shape, leaf.dtype)
    x = rng.standard_normal(leaf.shape, dtype=np.float32)
    x *= 0.02
    return jnp.asarray(x)  # a JAX array, as the trainer holds it

  pure = jax.tree_util.tree_map_with_path(fill, nnx.to_pure_dict(state))
  nnx.replace_by_pure_dict(state, pure)
  return nnx.merge(graphdef, state)


def build_big_dir(path: str, cfg) -> str:
  """Writes (once) the random 0.5B-shaped model with the char tokenizer."""
  import json  # pylint: disable=g-import-not-at-top

  from streamrl.models import hf, tiny  # pylint: disable=g-import-not-at-top

  cfg_path = os.path.join(path, "config.json")
  if os.path.isfile(cfg_path) and os.path.isfile(os.path.join(path, "model.safetensors")):
    with open(cfg_path) as f:
      if json.load(f) == hf.hf_config_dict(cfg, bos_token_id=1, eos_token_id=2, pad_token_id=0):
        return path
  t0 = time.perf_counter()
  model = random_model(cfg, seed=1)
  tiny.build_tiny_model_dir(path, cfg, model=model)
  print(
      f"[bench] built {path} ({cfg.num_params / 1e6:.0f}M params) in "
      f"{time.perf_counter() - t0:.1f}s",
      flush=True,
  )
  return path
