"""The tiny PPO workload the benchmarks (experiments/bench/bench_modes.py,
calibrate_sim.py, bench_elastic.py) and launch/measure.py share.

`Workload` holds the typed settings, the examples, the warm-started policy
directory and the tokenizer, and builds everything else through the public
API a real run uses (`streamrl/train.py`): a fresh `RLTrainer.from_settings`
per arm (equal settings share the jitted update step, so a second trainer
compiles nothing), the rollout of a mode (`LocalRollout` in this process for
colocated, a `StreamGenerationService` on the local Ray otherwise), the mode
itself (`pipeline.make_mode`, with its generation scheduler) and
its `rounds(it)` (`pipeline.make_rounds`). `train_alone` is the trainer's side
of `train.train_iteration` on given samples, timed in parts.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time

# The cores this process may use, before any pinning narrows its mask.
ALL_CORES = tuple(sorted(os.sched_getaffinity(0)))

MODES = ("colocated", "sync", "stream", "async", "async_partial", "async_partial_sibling")


def now() -> float:
  return time.perf_counter()


def with_mode(s, mode: str):
  """Settings `s` with `pipeline.mode=mode`, validated again (the effective
  rollout correction, for one, depends on the mode). colocated is the
  baseline of configs/colocated.py: FIFO order, weights loaded in process;
  async_partial is async with `pipeline.partial=on`, and
  async_partial_sibling that with `scheduler.sibling_lengths=on`."""
  from streamrl.config import settings as settings_lib  # pylint: disable=g-import-not-at-top

  partial = "on" if mode.startswith("async_partial") else "off"
  siblings = "on" if mode == "async_partial_sibling" else "off"
  mode = "async" if mode.startswith("async_partial") else mode
  out = s.replace(
      pipeline=dataclasses.replace(s.pipeline, mode=mode, partial=partial),
      scheduler=dataclasses.replace(s.scheduler, sibling_lengths=siblings),
  )
  if mode == "colocated":
    out = out.replace(
        scheduler=dataclasses.replace(s.scheduler, kind="fifo"),
        transfer=dataclasses.replace(s.transfer, enabled=False),
    )
  settings_lib.validate(out, check_files=False)
  return out


def unpin() -> None:
  """Gives this process every core back, before each arm.

  colocated must use both cores, and a disaggregated arm pins this process
  (the trainer) to the trainer's share anew.
  """
  from streamrl import cluster  # pylint: disable=g-import-not-at-top

  cluster.pin_process_threads(ALL_CORES)


def pin_trainer(s) -> None:
  """Keeps this process (the trainer) off the generators' cores, as
  `streamrl.experiment.run` does for an in-process trainer on a local Ray.

  XLA sized its thread pool before this pinning (the process is reused by
  every arm), so only the mask changes.
  """
  from streamrl import cluster  # pylint: disable=g-import-not-at-top

  shares = cluster.plan_cpu_shares(s.cluster.generator_cpus, s.cluster.trainer_cpus, ALL_CORES)
  cluster.pin_process_threads(shares.trainer_cores)


def generator_cores(s) -> tuple[int, ...]:
  from streamrl import cluster  # pylint: disable=g-import-not-at-top

  return cluster.plan_cpu_shares(
      s.cluster.generator_cpus, s.cluster.trainer_cpus, ALL_CORES
  ).generator_cores


def set_engine_threads(n: int) -> None:
  """torch's thread count for an in-process engine, before the first one starts.

  One by default: decoding the tiny policy gains nothing from a second
  thread, and on a shared machine a 2-thread OpenMP team waits at every
  barrier for whichever thread lost its core (the same generation ran many
  times slower and erratic: experiments/RESULTS.md). vLLM's CPU worker forbids changing it
  once an engine exists.
  """
  import torch  # pylint: disable=g-import-not-at-top

  if torch.get_num_threads() != n:
    torch.set_num_threads(n)


class Workload:
  """Settings, examples, policy directory, tokenizer; builds the run's parts."""

  def __init__(self, s, workdir: str):
    from streamrl.trainer import setup  # pylint: disable=g-import-not-at-top

    self.s = s
    self.workdir = workdir
    self.train_examples, _ = setup.load_examples(s)
    t0 = now()
    self.model_dir = setup.policy_dir(s, workdir, self.train_examples)
    print(f"policy: {self.model_dir} ({now() - t0:.0f} s)", flush=True)
    self.tokenizer = setup.make_tokenizer(self.s, self.model_dir)
    # The prompts a run would keep (too long for the engine: dropped or cut, as
    # task.truncation says), so the benchmarks generate what a run generates.
    self.train_examples, _ = setup.fit_prompts(s, self.tokenizer, self.train_examples, [])
    self._local = None
    self._cluster = None

  # ------------------------------------------------------------------ data
  def loader(self):
    from streamrl.data.loader import PromptLoader  # pylint: disable=g-import-not-at-top

    return PromptLoader(self.train_examples, self.s.trainer.prompts_per_iteration, seed=self.s.seed)

  def batches(self, n: int):
    """The first n prompt batches of the loader: what every mode generates."""
    loader = self.loader()
    return [next(loader) for _ in range(n)]

  def requests(self, examples):
    """(requests, {request id: Example}) of a prompt batch, as a Round holds them."""
    from streamrl.data.loader import make_requests  # pylint: disable=g-import-not-at-top

    return make_requests(examples, self.tokenizer, self.s.advantage.group_size)

  def rewarder(self):
    from streamrl.trainer import setup  # pylint: disable=g-import-not-at-top

    return setup.make_rewarder(self.s, self.tokenizer)

  # --------------------------------------------------------------- trainer
  def trainer(self, s):
    """A new trainer on the warm-started policy with a fresh optimizer state."""
    from streamrl.models import hf  # pylint: disable=g-import-not-at-top
    from streamrl.trainer.rl_trainer import RLTrainer  # pylint: disable=g-import-not-at-top

    _, policy = hf.load_hf(self.model_dir)
    return RLTrainer.from_settings(policy, s)

  # --------------------------------------------------------------- rollout
  def cluster(self, s):
    """The local Ray (started once; its core shares are planned over all cores)."""
    if self._cluster is None:
      from streamrl import cluster  # pylint: disable=g-import-not-at-top

      self._cluster = cluster.init_ray_for(s.cluster, s.gpus_needed)
    return self._cluster

  def local_rollout(self, threads: int = 1):
    """The in-process engine (`threads` torch threads): colocated's rollout
    and the instance the profiler measures. It lives only while no Ray
    generator does (`close_local`): Ray's memory monitor kills actors when
    the shared machine runs short."""
    if self._local is None:
      set_engine_threads(threads)
      from streamrl.generator.local import LocalRollout  # pylint: disable=g-import-not-at-top

      s = self.s
      self._local = LocalRollout(
          self.model_dir,
          s.engine,
          dtype=s.model.dtype,
          seed=s.seed,
          env=s.env,
          chat_template=s.task.chat_template,
          lora_rank=s.trainer.lora_rank,
      )
    return self._local

  def close_local(self) -> None:
    if self._local is not None:
      self._local.close()
      self._local = None
      gc.collect()

  def ray_rollout(self, s):
    """One Ray generator service as the settings describe it (local Ray)."""
    from streamrl.generator.service import StreamGenerationService  # pylint: disable=g-import-not-at-top

    return StreamGenerationService(
        self.model_dir,
        s.engine,
        dtype=s.model.dtype,
        seed=s.seed,
        cluster=self.cluster(s),
        stall_timeout_s=s.pipeline.stall_timeout_s,
        transfer=s.transfer,
        stoppable=s.partial_rollouts,
        pooled=s.scheduler.pool == "shared",
        env=s.env,
        chat_template=s.task.chat_template,
        lora_rank=s.trainer.lora_rank,
    )

  def rollout(self, s, engine_threads: int = 1):
    """The rollout a real run of `s` uses: the in-process engine for
    colocated (this process then uses every core; `engine_threads` torch
    threads), Ray actors otherwise (this process, the trainer, pinned to the
    trainer's core)."""
    unpin()
    if s.pipeline.mode == "colocated":
      return self.local_rollout(engine_threads)
    self.cluster(s)  # Ray starts while this process may still use every core.
    pin_trainer(s)
    return self.ray_rollout(s)

  def mode(self, s, rollout, loader):
    """The mode of `s` over `rollout` (fifo/skew scheduler as configured),
    taking its prompt batches from `loader`."""
    from streamrl import pipeline  # pylint: disable=g-import-not-at-top

    return pipeline.make_mode(
        s,
        rollout,
        model_dir=self.model_dir,
        workdir=None,
        rounds=pipeline.make_rounds(loader, self.tokenizer, s.advantage.group_size),
    )


# The string-task workload of configs/ppo_strings.py with FIFO order and no
# transfer service: what calibrate_sim.py checks the simulator against.
STRING_WORKLOAD = {
    "task.kind": "synthetic",
    "task.trace_token_fraction": 1.0,
    "engine.max_model_len": 128,
    "scheduler.kind": "fifo",
    "transfer.enabled": False,
}


def make_settings(
    *,
    num_iterations: int,
    prompts: int | None = None,
    mini_batch: int | None = None,
    max_num_seqs: int | None = None,
    max_tokens: int | None = None,
    extra: dict | None = None,
    overrides=(),
    config_name: str = "ppo",
):
  """configs/<config_name>.py (default ppo) with the benchmark's settings, as
  typed Settings.

  One generator core and one trainer core; `num_iterations` sets the lr
  horizon and must be the same in every mode of a comparison. A size left
  None keeps the config's value (`mini_batch` also sets the micro-batch).
  `overrides` are "key=value" strings of config keys.
  """
  from streamrl import config as config_lib  # pylint: disable=g-import-not-at-top
  from streamrl.config import settings  # pylint: disable=g-import-not-at-top

  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  config = config_lib.load_config(os.path.join(repo, "configs", f"{config_name}.py"))
  sizes = {
      "trainer.prompts_per_iteration": prompts,
      "trainer.mini_batch_size": mini_batch,
      "trainer.micro_batch_size": mini_batch,
      "engine.max_num_seqs": max_num_seqs,
      "sampling.max_tokens": max_tokens,
  }
  values = {
      **{k: v for k, v in sizes.items() if v is not None},
      "trainer.num_iterations": num_iterations,
      "cluster.generator_cpus": 1,
      "cluster.trainer_cpus": 1,
      "log.progress": False,
      **(extra or {}),
  }
  config = config_lib.apply_overrides(config, values)
  config = config_lib.apply_overrides(config, list(overrides))
  return settings.from_config(config)


def config_json(s) -> dict:
  """The settings as the nested config dict (for summary.json)."""
  import json  # pylint: disable=g-import-not-at-top
  from streamrl.config import settings  # pylint: disable=g-import-not-at-top

  return json.loads(settings.to_config(s).to_json())


def describe(s) -> str:
  """One line on the algorithm of `s`."""
  adv, tr, e = s.advantage, s.trainer, s.engine
  return (
      f"{tr.prompts_per_iteration} prompts x {adv.group_size} samples/iteration, "
      f"{adv.estimator} (critic={adv.use_critic}, reference={s.kl.use_reference}), "
      f"mini-batch {tr.mini_batch_size}, ppo_epochs {tr.ppo_epochs}, max_num_seqs "
      f"{e.max_num_seqs}, max_tokens {s.sampling.max_tokens}"
  )


def train_alone(
    trainer, rewarder, chunks, examples_by_id, *, it: int, ppo_epochs: int, seed: int, copy: bool
) -> tuple[float, float]:
  """The trainer's side of `train.train_iteration` on given chunks of samples.

  The same calls in the same order (snapshot, then per chunk: reward,
  prepare, one update per mini-batch in the loop's shuffled order; then the
  other PPO epochs), without a mode, a push or a timeline. `copy` is the
  snapshot's (a mode that scores every sample before the first update
  needs none). Returns (forward seconds: snapshot + rewards + prepare,
  update seconds: every optimizer step, waited for).
  """
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng([seed, it])
  fwd = upd = 0.0
  t0 = now()
  old = trainer.snapshot(copy=copy)
  jax.block_until_ready(jax.tree.leaves(old))
  fwd += now() - t0
  minis = []
  for chunk in chunks:
    t0 = now()
    rewards, _ = rewarder(chunk, examples_by_id)
    part, _ = trainer.prepare(chunk, rewards, old)
    t1 = now()
    out = [trainer.update(part[j]) for j in rng.permutation(len(part))]
    jax.block_until_ready(out)
    fwd, upd = fwd + t1 - t0, upd + now() - t1
    minis.extend(part)
  t0 = now()
  out = []
  for _ in range(ppo_epochs - 1):
    out.extend(trainer.update(minis[j]) for j in rng.permutation(len(minis)))
  jax.block_until_ready(out)
  return fwd, upd + now() - t0


def precompile(work: Workload, settings_list, num_batches: int, streaming: bool = True) -> None:
  """Fills the jit caches for every padded length the workload can produce.

  jit caches are per process: a timed iteration that met a new length would
  pay a compile, and whichever mode ran first would pay for the others. For
  each distinct loss and sampling config among `settings_list` (async's
  rollout correction differs; the programs take both as static arguments),
  a fresh trainer (what every arm starts with) runs
  `RLTrainer.warm_up` up to the longest prompt of the first `num_batches`
  batches plus `sampling.max_tokens`: the whole batch scored by the live
  parameters and, with `streaming`, one mini-batch scored by a copied
  snapshot too (as stream mode does). Trainers of equal settings share
  these compiled functions.
  """
  s0 = work.s
  longest = max(
      len(work.tokenizer.encode_prompt(ex.prompt))
      for batch in work.batches(num_batches)
      for ex in batch
  )
  distinct = {}
  for s in settings_list:
    distinct.setdefault((s.loss.resolved(s.pipeline.mode), s.sampling), s)
  sizes = {s0.samples_per_iteration, s0.trainer.mini_batch_size} if streaming else set()
  t0 = now()
  for s in distinct.values():
    trainer = work.trainer(s)
    trainer.warm_up(
        longest + s.sampling.max_tokens,
        chunk_sizes=sorted(sizes | {s0.samples_per_iteration}),
        snapshot_copies=(True, False) if streaming else (False,),
    )
    trainer.export_weights()
  print(
      f"precompiled {len(distinct)} trainer config(s) for samples of up to "
      f"{longest + s0.sampling.max_tokens} tokens ({now() - t0:.0f} s)",
      flush=True,
  )
