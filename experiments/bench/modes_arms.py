"""The arms of bench_modes.py: one pipeline mode across blocks (`Arm`) and the
generator and the trainer each alone (`AloneArms`), with what they measure.

`Arm.run_block` builds the mode's rollout and mode, loads the arm's current
weights as a resumed run does, runs `train.train_iteration` on a `Timeline`
and closes it all; `AloneArms.run_block` generates the same batches on one
Ray generator instance and does the trainer's work on them apart.
"""

import os
import re
import statistics
import time

from streamrl.workload import Workload, now, pin_trainer, train_alone, unpin, with_mode


def proc_cpu_s(pid: int | None) -> float:
  """CPU seconds (user + system, all threads) a process has used so far."""
  if pid is None:
    return time.process_time()
  try:
    with open(f"/proc/{pid}/stat") as f:
      fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
  except (OSError, IndexError, ValueError):
    return float("nan")


def rss_gib() -> float:
  with open("/proc/self/status") as f:
    kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
  return kib / 2**20


# ------------------------------------------------------------------ the arms
class Arm:
  """One mode: its trainer, loader and measurements across blocks.

  Each block builds the mode's rollout (in-process engine or Ray actor),
  loads the arm's current weights into it the way a resumed run does
  (`rollout.update(trainer.export_weights(), next iteration).wait()`), sets
  the mode up over it (`pipeline.make_mode`), runs its iterations through
  `train.train_iteration` and closes everything, so only one engine holds
  memory at a time. Every arm has a trainer of its own.
  """

  def __init__(self, work: Workload, mode: str, engine_threads: int = 1):
    self.mode, self.work = mode, work
    self.engine_threads = engine_threads  # torch threads of colocated's in-process engine
    self.s = with_mode(work.s, mode)
    self.trainer = work.trainer(self.s)
    self.loader, self.rewarder = work.loader(), work.rewarder()
    self.next_it = 0
    self.windows: list[tuple[int, float, float]] = []  # every iteration
    self.timed: list[tuple[int, float, float]] = []
    self.outs: list[dict] = []
    self.intervals: list[tuple[str, float, float, str]] = []
    self.cpu_this = self.cpu_gen = 0.0
    self.startup_s: list[float] = []
    self.digest_it0 = None
    self.loads: list[float] = []
    self.carry = None  # async_partial: the unfinished responses, from block to block

  def run_block(self, n: int, untimed: int) -> None:
    """n iterations in a row on a fresh rollout and mode; the first `untimed` are not timed."""
    from streamrl import train  # pylint: disable=g-import-not-at-top
    from streamrl.pipeline.timeline import Timeline  # pylint: disable=g-import-not-at-top

    s, trainer = self.s, self.trainer
    t0 = now()
    rollout = self.work.rollout(s, engine_threads=self.engine_threads)
    first_it = self.next_it
    try:
      if self.next_it:
        rollout.update(trainer.export_weights(), self.next_it).wait()
      mode = self.work.mode(s, rollout, self.loader)
      if self.carry is not None:
        mode.restore(self.carry, self.loader.get_state())
      self.startup_s.append(now() - t0)
      print(
          f"  {self.mode:9s} rollout and mode up in {self.startup_s[-1]:.0f} s (untimed)",
          flush=True,
      )
      gen_pid = rollout.placement[0]["pid"] if 0 in rollout.placement else None
      self.loads.append(os.getloadavg()[0])
      timeline = Timeline()
      last = None
      try:
        for j in range(n):
          it = self.next_it
          c0 = (time.process_time(), proc_cpu_s(gen_pid) if gen_pid else float("nan"))
          start = now()
          x = train.train_iteration(
              it,
              mode,
              trainer,
              self.rewarder,
              timeline,
              ppo_epochs=s.trainer.ppo_epochs,
              seed=s.seed,
          )
          scalars = train.iteration_scalars(x, timeline, rollout)
          end = now()
          c1 = (time.process_time(), proc_cpu_s(gen_pid) if gen_pid else float("nan"))
          out = {
              "samples": x.samples,
              "scalars": scalars,
              "lengths": [len(q.token_ids) for q in x.samples],
              # The policy's own tokens (a trajectory's observations are the tool's).
              "policy_tokens": [
                  len(q.token_ids) if q.mask is None else sum(q.mask) for q in x.samples
              ],
          }
          self.windows.append((it, start, end))
          if it == 0:
            self.digest_it0 = digest(x.samples)
          if j >= untimed:
            self.timed.append((it, start, end))
            self.outs.append(out)
            self.cpu_this += c1[0] - c0[0]
            self.cpu_gen += c1[1] - c0[1]
          print(
              f"  {self.mode:9s} it {it:2d}{'  untimed' if j < untimed else '         '}"
              f" {end - start:6.2f} s  gen {scalars.get('time/generation_s', 0):5.2f} s  "
              f"train {scalars.get('time/training_s', 0):5.2f} s  "
              f"push {scalars.get('time/weight_update_s', 0):4.2f} s  "
              f"mean len {scalars['response_length/mean']:4.1f}  "
              f"staleness {scalars['staleness/mean']:.0f}"
              + (
                  f"  resumed {scalars['partial/resumed_fraction']:.2f}"
                  if "partial/resumed_fraction" in scalars
                  else ""
              ),
              flush=True,
          )
          self.next_it += 1
          last = x
      finally:
        mode.close()  # async: waits for its read-ahead generation and the last push
      if s.pipeline.mode == "async" and last is not None:
        # Its read-ahead took the next batch from the loader; the next block
        # generates that batch again, so every mode sees the same prompts
        # (async_partial: and resumes the responses that round left unfinished).
        self.loader.set_state(last.generated.round.loader_state)
        self.carry = last.generated.round.carry
      timeline.copy_generator_intervals(rollout.busy_intervals)
      self.intervals += labelled_intervals(
          timeline.intervals, [w for w in self.windows if w[0] >= first_it]
      )
    finally:
      if self.mode == "colocated":
        self.work.close_local()  # shuts the in-process engine down, freeing its KV cache
      else:
        rollout.close()

  def result(self) -> dict:
    from streamrl.pipeline.timeline import Timeline  # pylint: disable=g-import-not-at-top

    tl = Timeline()
    for iv in self.intervals:
      tl.add(*iv)
    wall = sum(e - s for _, s, e in self.timed)
    n = sum(len(o["samples"]) for o in self.outs)
    busy = {st: sum(tl.busy_seconds(st, s, e) for _, s, e in self.timed) for st in tl.stages()}
    mean = lambda k: statistics.fmean(o["scalars"].get(k, 0.0) for o in self.outs)
    # Over the iterations that logged `k` (nan when none did).
    logged = lambda k: statistics.fmean(
        [o["scalars"][k] for o in self.outs if k in o["scalars"]] or [float("nan")]
    )
    per_iter = [len(o["samples"]) / (e - s) for o, (_, s, e) in zip(self.outs, self.timed)]
    return {
        "mode": self.mode,
        "samples": n,
        "wall_s": wall,
        "samples_per_s": n / wall,
        "samples_per_s_per_iteration": per_iter,
        "tokens_per_s": sum(sum(o["lengths"]) for o in self.outs) / wall,
        # The shape the simulator replays (experiments/sim/calibrate_costs.py's `predict`).
        "output_lens": [n for o in self.outs for n in o["lengths"]],
        "prompt_lens": [len(q.prompt_token_ids) for o in self.outs for q in o["samples"]],
        "policy_tokens_per_s": sum(sum(o["policy_tokens"]) for o in self.outs) / wall,
        "ranker_recall20": logged("ranker/pre_recall20"),
        "env_turns_mean": logged("env/turns_mean"),
        "env_engine_idle_s": logged("env/engine_idle_s"),
        "startup_s": self.startup_s,
        "digest_it0": self.digest_it0,
        # Over the timed iterations: idle share of each stage, and cores' worth
        # of CPU used by this process (the trainer; colocated: trainer +
        # engine) and by the generator actor.
        "bubbles": {st: 1.0 - b / wall for st, b in busy.items()},
        "cpu_this": self.cpu_this / wall,
        "cpu_gen": self.cpu_gen / wall,
        "cpu_s_per_iteration": (self.cpu_this / len(self.timed), self.cpu_gen / len(self.timed)),
        "staleness_mean": mean("staleness/mean"),
        "generation_s": mean("time/generation_s"),
        "training_s": mean("time/training_s"),
        "weight_update_s": mean("time/weight_update_s"),
        "load": (min(self.loads), max(self.loads)),
        "windows": self.windows,
        "timed": self.timed,
        "timeline": self.intervals,
    }


def admission_lengths(requests, samples, gen_s: float) -> dict:
  """One generated batch as the simulator's cost models take it: prompt and
  output lengths in admission (request) order, the tokens the trainer sees,
  and the generation's seconds."""
  by_rid = {q.prompt_id: q for q in samples}
  order = [by_rid[rid] for rid, _ in requests]
  return {
      "gen_s": gen_s,
      "prompt_lens": [len(q.prompt_token_ids) for q in order],
      "output_lens": [len(q.token_ids) for q in order],
      "tokens": sum(len(q.prompt_token_ids) + len(q.token_ids) for q in order),
  }


def digest(samples) -> str:
  """Short hash of (request id, tokens) of a batch: equal batches, equal digests."""
  import hashlib  # pylint: disable=g-import-not-at-top

  h = hashlib.sha256()
  for s in sorted(samples, key=lambda s: s.prompt_id):
    h.update(repr((s.prompt_id, tuple(s.token_ids))).encode())
  return h.hexdigest()[:8]


def labelled_intervals(intervals, windows) -> list:
  """One block's intervals, each labelled with its iteration ("gen k",
  "train k", "epochs k"); `windows` are that block's iterations."""
  out, gen_count, first = [], {}, windows[0][0]
  for stage, start, end, label in sorted(intervals, key=lambda x: x[1]):
    if stage.startswith("generator"):
      # One stream per instance per iteration, in order (async's read-ahead
      # of the block's last iteration is the one after it).
      k = gen_count.get(stage, 0)
      gen_count[stage] = k + 1
      label = f"gen {first + k}"
    elif not re.search(r"\d+$", label or ""):
      it = next((i for i, s, e in windows if s <= start < e), windows[-1][0])
      label = f"{label or 'busy'} {it}"
    out.append((stage, start, end, label))
  return out


class AloneArms:
  """Generation alone and training alone, on the disaggregated shares.

  Generation: one Ray generator instance on the generator core (started per
  block, like the modes' instances), the same prompt batches and sampling
  seeds as the modes (`local.round_seed`), nothing else running.
  Training: a trainer of its own, in this process pinned to the trainer
  core, doing the trainer's side of `train.train_iteration` on those
  samples (`modes_workload.train_alone`: rewards, snapshot, prepare, PPO
  updates); the Flax->HF weight export is timed apart. With `every_core`
  the same work again on every core, as colocated trains.
  Push: one blocking weight update into the generator per block.
  `per_batch` and `push_s` are the simulator's inputs (`predict_modes`).
  """

  def __init__(self, work: Workload, every_core: bool = False):
    self.work = work
    self.s = with_mode(work.s, "sync")
    self.trainer = work.trainer(self.s)
    self.rewarder = work.rewarder()
    self.loader = work.loader()
    self.next_it = 0
    self.gen = {"samples": 0, "wall_s": 0.0, "cpu": 0.0}
    self.train = {"samples": 0, "wall_s": 0.0, "cpu": 0.0, "export_s": 0.0}
    self.digest_it0 = None
    # Also the trainer's work on every core, as colocated trains (its cost model).
    self.every_core = every_core
    # Per timed iteration, what the simulator's cost models take
    # (experiments/sim/calibrate_costs.py's `cost_models`), and the pushes.
    self.per_batch: list[dict] = []
    self.push_s: list[float] = []

  def run_block(self, n: int, untimed: int) -> None:
    from streamrl.generator.local import round_seed  # pylint: disable=g-import-not-at-top

    s = self.s
    svc = self.work.rollout(s)  # this process pinned to the trainer's core
    generated = []
    try:
      gen_pid = svc.placement[0]["pid"]
      for j in range(n):
        it = self.next_it
        requests, by_id = self.work.requests(next(self.loader))
        c0, t0 = proc_cpu_s(gen_pid), now()
        samples = sorted(
            svc.generate(requests, s.sampling, seed=round_seed(s.seed, it)),
            key=lambda q: q.prompt_id,
        )
        t1, c1 = now(), proc_cpu_s(gen_pid)
        if it == 0:
          self.digest_it0 = digest(samples)
        if j >= untimed:
          self.gen["samples"] += len(samples)
          self.gen["wall_s"] += t1 - t0
          self.gen["cpu"] += c1 - c0
        generated.append((it, samples, by_id, admission_lengths(requests, samples, t1 - t0)))
        self.next_it += 1
      # One blocking push (Flax -> HF export + load), a version above any generated.
      t0 = now()
      svc.update(self.trainer.export_weights(), self.next_it).wait()
      self.push_s.append(now() - t0)
    finally:
      svc.close()
    for j, (it, samples, by_id, rec) in enumerate(generated):
      t0, c0 = now(), time.process_time()
      rec["fwd_s"], rec["upd_s"] = self._train(samples, by_id, it)
      t1, c1 = now(), time.process_time()
      self.trainer.export_weights()
      t2 = now()
      if j >= untimed:
        self.train["samples"] += len(samples)
        self.train["wall_s"] += t1 - t0
        self.train["cpu"] += c1 - c0
        self.train["export_s"] += t2 - t1
        if self.every_core:
          unpin()
          try:
            rec["every_core"] = dict(zip(("fwd_s", "upd_s"), self._train(samples, by_id, it)))
          finally:
            pin_trainer(s)
        self.per_batch.append(rec)

  def _train(self, samples, by_id, it: int) -> tuple[float, float]:
    """(forward, update) seconds of the trainer's work on one batch (`train_alone`)."""
    s = self.s
    return train_alone(
        self.trainer,
        self.rewarder,
        [samples],
        by_id,
        it=it,
        ppo_epochs=s.trainer.ppo_epochs,
        seed=s.seed,
        copy=False,
    )

  def results(self) -> tuple[dict, dict]:
    g, t = self.gen, self.train
    batch = self.s.samples_per_iteration
    gen = {
        "samples": g["samples"],
        "wall_s": g["wall_s"],
        "samples_per_s": g["samples"] / g["wall_s"],
        "cpu_gen": g["cpu"] / g["wall_s"],
        "cpu_s_per_iteration": g["cpu"] * batch / g["samples"],
        "digest_it0": self.digest_it0,
    }
    trn = {
        "samples": t["samples"],
        "wall_s": t["wall_s"],
        "samples_per_s": t["samples"] / t["wall_s"],
        "cpu_this": t["cpu"] / t["wall_s"],
        "cpu_s_per_iteration": t["cpu"] * batch / t["samples"],
        "samples_per_s_with_export": t["samples"] / (t["wall_s"] + t["export_s"]),
    }
    return gen, trn


# ---------------------------------------------------------------- simulator
def predict_modes(s, results: dict, alone: AloneArms, profile) -> dict:
  """The simulator's samples/s for each mode of `results` it models, from
  costs measured one part at a time (experiments/sim/calibrate_costs.py,
  as calibrate_sim.py predicts, with the sides' isolated speeds):

  generator: `profile` (PTL(BS) of the in-process instance) plus the
    per-request cost that makes the replay of the generator-alone batches
    match their measured time; trainer: forward and update seconds per token
    of the trainer alone (colocated: on every core, `AloneArms.every_core`);
    transfer: the mean push. Each mode is simulated on its own output and
    prompt lengths (its policy drifts), nothing else taken from its run.
  Returns {mode: {"samples_per_s", "iteration_s", "gen_s", "train_s"}}.
  """
  from experiments.sim.calibrate_costs import PREDICTED, cost_models, predict  # pylint: disable=g-import-not-at-top

  mean_prompt = statistics.fmean(n for b in alone.per_batch for n in b["prompt_lens"])
  out = {}
  for mode, res in results.items():
    if mode not in PREDICTED:
      continue
    per_batch = alone.per_batch
    if mode == "colocated":
      per_batch = [{**b, **b["every_core"]} for b in per_batch if "every_core" in b]
    if not per_batch:
      continue
    costs = cost_models(
        mode, profile, per_batch, alone.push_s, s.engine.max_num_seqs, mean_prompt, "mean"
    )
    arm = {
        "mode": mode,
        "costs": {"isolated": {"mean": costs}},
        "condition": "isolated",
        "output_lens": res["output_lens"],
        "prompt_lens": res["prompt_lens"],
    }
    out[mode] = {**predict(arm, s), "costs": costs}
  return out


# ------------------------------------------------------------------- report
