"""The generation scheduler's settings (`scheduler.*`): which instance
generates which prompt, in which order."""

from __future__ import annotations

import dataclasses
import os

from streamrl import config as config_lib
from streamrl.config.checks import need, one_of, positive
from streamrl.scheduling.policy import SCHEDULERS
from streamrl.scheduling.pool import POOLS

# What Algorithm 2 minimises over the groups' predicted latencies: their maximum
# ("makespan") or their sum (the paper's).
DISPATCH_OBJECTIVES = ("makespan", "sum")
LATENCY_MODELS = ("paper", "simulate")


@dataclasses.dataclass(frozen=True)
class Scheduler:
  """Which instance generates which prompt, in which order.

  kind: fifo | skew (ranker + Algorithm 2 dispatch + LPT) | oracle (true
  lengths, synthetic tasks). latency_model: "paper" (PTL(BS) * L_avg *
  ceil(M/BS)) or "simulate" (replays continuous batching through the profile).
  """

  kind: str = "fifo"
  long_tail_alpha: float = 0.2
  objective: str = "makespan"
  latency_model: str = "paper"
  latency_profile: str = ""
  ranker_config: str = "configs/ranker.py:tiny"
  ranker_checkpoint: str = ""
  length_history: int = 1024
  # Each prompt's newest response lengths kept (by prompt id, for the run, in
  # its checkpoints): a prompt seen in an earlier epoch is predicted mostly
  # from them (streamrl/scheduling/lengths.py); 0: the ranker alone.
  prompt_lengths: int = 8
  # Where the skew scheduler's ranker predicts and refreshes when the
  # generators are Ray actors: "generators" (its own process beside them, so
  # the trainer's cores only train) or "trainer" (in the trainer's process).
  ranker_side: str = "generators"
  # Group-aware length prediction (streamrl/scheduling/siblings.py): "on"
  # keeps each prompt's samples on one instance, which admits one per prompt
  # first and orders the rest by what their finished siblings say.
  sibling_lengths: str = "off"
  # Where an instance's next request comes from (streamrl/scheduling/pool.py):
  # "fixed" (its own list, handed out before the round) or "shared" (one pool
  # for all instances, taken from as slots free up, longest estimate first,
  # refined by finished siblings; Ray generators only).
  pool: str = "fixed"
  # With a shared pool: once it is empty, an idle instance takes the running
  # request with the most tokens from the busiest one, which resumes there.
  migrate: bool = False
  # With a shared pool: a request that reaches this many tokens on a regular
  # instance moves to a long-tail instance (Algorithm 2's, else the last one),
  # which meanwhile runs few others; 0: off.
  straggler_tokens: int = 0

  def check(self) -> None:
    one_of("scheduler.kind", self.kind, SCHEDULERS)
    need(
        0 <= self.long_tail_alpha <= 1,
        f"scheduler.long_tail_alpha={self.long_tail_alpha} must be in [0, 1].",
    )
    one_of("scheduler.objective", self.objective, DISPATCH_OBJECTIVES)
    one_of("scheduler.latency_model", self.latency_model, LATENCY_MODELS)
    positive("scheduler.length_history", self.length_history)
    positive("scheduler.prompt_lengths", self.prompt_lengths, zero_ok=True)
    one_of("scheduler.ranker_side", self.ranker_side, ("generators", "trainer"))
    one_of("scheduler.sibling_lengths", self.sibling_lengths, ("off", "on"))
    one_of("scheduler.pool", self.pool, POOLS)
    need(
        not self.migrate or self.pool == "shared",
        "scheduler.migrate=True moves requests between the instances of a shared pool; set "
        "scheduler.pool='shared' or scheduler.migrate=False.",
    )
    positive("scheduler.straggler_tokens", self.straggler_tokens, zero_ok=True)
    need(
        not self.straggler_tokens or self.pool == "shared",
        "scheduler.straggler_tokens moves requests between the instances of a shared pool; "
        "set scheduler.pool='shared' or scheduler.straggler_tokens=0.",
    )
    need(
        self.pool == "fixed" or self.sibling_lengths == "off",
        "scheduler.sibling_lengths='on' orders each instance's own list; a shared pool "
        "already refines its estimates by finished siblings: set scheduler.sibling_lengths=off.",
    )
    need(
        self.sibling_lengths == "off" or self.kind != "fifo",
        "scheduler.sibling_lengths='on' refines the length predictions of the skew or "
        "oracle scheduler; set scheduler.kind=skew or scheduler.sibling_lengths=off.",
    )

  def check_files(self) -> None:
    if self.kind != "fifo" and self.latency_profile:
      need(
          os.path.isfile(self.latency_profile),
          f"scheduler.latency_profile={self.latency_profile!r} does not exist; measure one "
          "with streamrl.generator.profiler or leave it empty for the paper's curve.",
      )
    if self.kind != "skew":
      return
    if self.ranker_checkpoint:
      from streamrl.ranker import train as ranker_train  # pylint: disable=g-import-not-at-top

      ckpts = os.path.join(self.ranker_checkpoint, ranker_train.CHECKPOINT_DIR)
      need(
          os.path.isdir(ckpts) and any(n.isdigit() for n in os.listdir(ckpts)),
          f"scheduler.ranker_checkpoint={self.ranker_checkpoint!r} holds no ranker "
          "checkpoint; train one with launch/train_ranker.py --workdir=... or leave it "
          "empty to learn online.",
      )
    else:
      # configs/ranker.py:tiny names a file of the checkout, from any directory.
      path = config_lib.find_config_file(self.ranker_config).split(":", 1)[0]
      need(
          os.path.isfile(path),
          f"scheduler.ranker_config={self.ranker_config!r}: no file {path!r}; use "
          "configs/ranker.py:tiny or a path to a ranker config.",
      )
