"""What bench_modes.py and calibrate_sim.py share: the tiny PPO workload.

`Workload` holds the examples, the warm-started policy directory, the
tokenizer, one RLTrainer reused by every arm (its state reset per arm: a new
RLTrainer would recompile its update step, since the jit cache is keyed by
the optimizer objects, and the compile would land in a timed window) and,
for colocated and the profiler, one in-process engine.
"""

from __future__ import annotations

import gc
import os
import time

# The cores this process may use, before any pinning narrows its mask.
ALL_CORES = tuple(sorted(os.sched_getaffinity(0)))


def now() -> float:
  return time.perf_counter()


def with_mode(config, mode: str):
  from streamrl import config_utils  # pylint: disable=g-import-not-at-top
  return config_utils.apply_overrides(config, {"pipeline.mode": mode})


def unpin() -> None:
  """Gives this process every core back, before each arm.

  colocated must use both cores; and the disaggregated modes split "the
  available cores" (cluster.plan_cpu_shares) as seen by this process, which
  the previous mode's trainer pinning narrowed to the trainer's core.
  """
  from streamrl import cluster  # pylint: disable=g-import-not-at-top
  cluster.pin_process_threads(ALL_CORES)


def set_engine_threads(n: int) -> None:
  """torch's thread count for an in-process engine, before the first one starts.

  One by default: decoding the tiny policy gains nothing from a second
  thread, and on a shared machine a 2-thread OpenMP team waits at every
  barrier for whichever thread lost its core (measured here: the same
  generation 10x slower and erratic). vLLM's CPU worker forbids changing it
  once an engine exists.
  """
  import torch  # pylint: disable=g-import-not-at-top
  if torch.get_num_threads() != n:
    torch.set_num_threads(n)


class Workload:
  """Examples, policy, tokenizer, one trainer (reset per arm), the in-process engine."""

  def __init__(self, config, workdir: str):
    from streamrl import train  # pylint: disable=g-import-not-at-top
    self.config = config
    self.train_examples, _ = train.load_examples(config)
    t0 = now()
    self.model_dir = train.prepare_model_dir(config, workdir, self.train_examples)
    print(f"policy: {self.model_dir} ({now() - t0:.0f} s)", flush=True)
    self.tokenizer = train.Tokenizer(self.model_dir)
    self._trainer = None
    self._initial = None
    self._local = None

  def loader(self):
    from streamrl.data.loader import PromptLoader  # pylint: disable=g-import-not-at-top
    return PromptLoader(self.train_examples, self.config.trainer.prompts_per_iteration,
                        seed=self.config.seed)

  def batches(self, n: int):
    """The first n prompt batches of the loader: what every mode generates."""
    loader = self.loader()
    return [next(loader) for _ in range(n)]

  def rewarder(self):
    from streamrl import train  # pylint: disable=g-import-not-at-top
    from streamrl.data import rewards  # pylint: disable=g-import-not-at-top
    return train.Rewarder(rewards.get_reward_fn(self.config.task.reward), self.tokenizer)

  def trainer(self, config):
    """The shared trainer, reset to the warm-started policy and a fresh optimizer."""
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    if self._trainer is None:
      from streamrl.models import hf  # pylint: disable=g-import-not-at-top
      from streamrl.trainer.rl_trainer import RLTrainer  # pylint: disable=g-import-not-at-top
      _, policy = hf.load_hf(self.model_dir)
      self._trainer = RLTrainer(config, policy)
      self._initial = jax.tree.map(jnp.copy, self._trainer.state)
    t = self._trainer
    t.config = config
    t.state = jax.tree.map(jnp.copy, self._initial)
    t.begin_iteration(snapshot=False)  # no snapshot left from a previous arm
    return t

  def trainer_object(self):
    """The shared trainer as it is (each arm swaps its own state in)."""
    return self._trainer

  def initial_state(self):
    return self._initial

  def local_backend(self):
    """The in-process engine (one torch thread): colocated's backend and the
    instance the profiler measures. It lives only while no Ray generator
    does (`close_local`): Ray's memory monitor kills actors when the shared
    machine runs short."""
    if self._local is None:
      set_engine_threads(1)
      from streamrl.generator.local import LocalBackend  # pylint: disable=g-import-not-at-top
      self._local = LocalBackend(with_mode(self.config, "colocated"), self.model_dir)
    return self._local

  def close_local(self) -> None:
    if self._local is not None:
      self._local.close()
      self._local = None
      gc.collect()


def make_config(*, prompts: int, mini_batch: int, num_iterations: int, max_num_seqs: int,
                max_tokens: int, extra: dict | None = None, overrides=()):
  """configs/ppo.py with the benchmark workload's settings, validated.

  One generator core and one trainer core; `num_iterations` sets the lr
  horizon and must be the same in every mode of a comparison.
  """
  import importlib.util  # pylint: disable=g-import-not-at-top
  from streamrl import config_utils  # pylint: disable=g-import-not-at-top
  from streamrl.train import validate  # pylint: disable=g-import-not-at-top
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  spec = importlib.util.spec_from_file_location("workload_ppo",
                                                os.path.join(repo, "configs", "ppo.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  settings = {
      "trainer.prompts_per_iteration": prompts,
      "trainer.mini_batch_size": mini_batch,
      "trainer.micro_batch_size": mini_batch,
      "trainer.num_iterations": num_iterations,
      "generation.max_num_seqs": max_num_seqs,
      "generation.max_tokens": max_tokens,
      "cluster.generator_cpus": 1,
      "cluster.trainer_cpus": 1,
      "log.progress": False,
      **(extra or {}),
  }
  config = config_utils.apply_overrides(module.get_config(), settings)
  config = config_utils.apply_overrides(config, list(overrides))
  validate(config)
  return config


def precompile(work: Workload, num_batches: int, streaming: bool = True) -> None:
  """Fills the trainer's jit caches for every padded length the workload can produce.

  Mini-batches are padded to multiples of 32 tokens, and jit caches are per
  process: a timed iteration that met a new length would pay a compile, and
  whichever mode ran first would pay for the others. Synthetic samples of
  each length go through prepare (sync / async / colocated: the whole batch;
  stream: one mini-batch, on a snapshot) and two updates (the first step of
  a fresh state and the later ones compile apart); the trainer's state is
  then reset.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from streamrl.generator.vllm_engine import Sample  # pylint: disable=g-import-not-at-top
  from streamrl.trainer import experience  # pylint: disable=g-import-not-at-top
  cfg = work.config
  longest = max(len(work.tokenizer.encode_prompt(ex.prompt))
                for batch in work.batches(num_batches) for ex in batch)
  top = experience.bucket_length(longest + cfg.generation.max_tokens)
  trainer = work.trainer(cfg)
  mb = cfg.trainer.mini_batch_size
  full = cfg.trainer.prompts_per_iteration * cfg.algo.group_size
  t0 = now()
  for length in range(32, top + 1, 32):
    resp = max(1, length - 3)
    for size in sorted({full, mb} if streaming else {full}):
      samples = [Sample(prompt_id=i, prompt_token_ids=(1, 5), token_ids=(7,) * resp,
                        logprobs=(-1.0,) * resp, finish_reason="length", weight_version=0,
                        instance_id=0) for i in range(size)]
      scores = np.linspace(0, 1, size, dtype=np.float32)
      for snapshot in (True, False) if streaming else (False,):
        trainer.begin_iteration(snapshot=snapshot)
        minis, _ = trainer.prepare(samples, scores)
    trainer.train_minibatch(minis[0])
    trainer.train_minibatch(minis[0])
    trainer.state = jax.tree.map(jnp.copy, work.initial_state())
  trainer.hf_tensors()
  print(f"precompiled the trainer for lengths 32..{top} ({now() - t0:.0f} s)", flush=True)
