r"""Pipeline modes side by side: colocated, sync, stream, async on one workload.

  python experiments/bench_modes.py [--quick] [--blocks=2] [--iterations=8]

What runs (everything real: vLLM engines, Ray actors, the JAX trainer), each
mode exactly as a real run (`streamrl.train.run`) runs it:
  * The tiny PPO policy of configs/ppo.py, warm-started once into
    `--workdir` (`warmstart.prepare_model_dir`); every mode starts from those
    weights and a fresh optimizer state, in a trainer of its own
    (`RLTrainer.from_settings`; trainers of equal settings share their
    compiled update step). Before any arm, the jitted functions are compiled
    for every padded length the workload can produce and for each mode's
    loss config (async's rollout correction differs), so no arm pays a
    compile that another got for free.
  * Each mode's rollout is the real one: `colocated` runs a vLLM engine in
    this process (`LocalRollout`) and uses both cores; the others run one
    Ray generator actor (`StreamGenerationService` on a local Ray) pinned to
    core 0 and pin this process (the trainer) to core 1. The mode comes
    from `train.setup_mode` (generation scheduler + `pipeline.make_mode`)
    with `rounds(it)` from `train.make_rounds`, and every iteration is
    `train.train_iteration` + `train.iteration_scalars` on a `Timeline`.
    Same prompts (PromptLoader seed) and sampling seeds (`local.round_seed`)
    in every mode; the `it0 digest` column hashes iteration 0's samples
    (same weights everywhere): equal digests, identical generations.
  * Blocks: in each of `--blocks` blocks every arm runs `--warmup` untimed +
    `--iterations` timed iterations on a freshly built rollout and mode that
    first loads the arm's current weights, as a resumed run does
    (`rollout.update(trainer.export_weights(), next iteration).wait()`). The
    arm order rotates from block to block, so the load of a shared machine
    falls on all arms alike, and only one engine holds memory at a time.
    Start-up and the untimed iterations (first generations on a fresh engine
    are slow) stay outside the measurement. Throughput = samples / wall
    seconds summed over an arm's timed iterations.
  * Generation alone: one Ray generator instance on the generator core,
    generating the same batches with the same seeds, nothing else running.
    Training alone: the trainer pinned to its core, doing the loop's trainer
    work on those samples (rewards, old/ref logprobs, values, advantages, PPO
    updates: `modes_workload.train_alone`; the Flax->HF weight export is
    reported apart). Both in every block too.

Workload (defaults): every size from configs/ppo.py, the StreamRL default
(work traces, 64 prompts per iteration, PPO with critic and reference,
mini-batches of 32 in ragged micro-batches of 8, 2 PPO epochs, max_tokens
320); the disaggregated arms use its scheduler (ranker + skew dispatch) and
transfer service, colocated is the FIFO baseline without transfer
(configs/colocated.py). `async_partial` is async with `pipeline.partial=on`
(streamrl/pipeline/partial.py); its unfinished responses are carried from
one block to the next, as a resumed run carries them. Each mini-batch is
padded to its longest sample: sync/async/colocated cut the length-sorted
batch into mini-batches, stream fills one mini-batch per length bucket as
samples arrive (`stream.LengthBatcher`). Every arm trains its own policy
from the same warm start, so their response lengths drift apart over the
iterations; the response tokens/s line compares the arms on tokens.

The string-task workload of earlier rounds is `--max_num_seqs=4
--max_tokens=56 --mini_batch=16 --ppo_epochs=1 --override=task.kind=synthetic
--override=engine.max_model_len=128 --override=scheduler.kind=fifo
--override=transfer.enabled=False`.

Measured results: experiments/RESULTS.md (section bench_modes.py).

The trainer runs in this process (the loop is called directly, so
`cluster.trainer_actor` does not apply): one set of compiled functions then
serves every arm. It is pinned to the trainer's core like a TrainerActor,
except that XLA sized its thread pool before the pinning (two threads on one
core; a check here: 0.64-0.69 CPU-s per training iteration either way).

Columns: `gen s`, `train s`, `push s` are the loop's own
time/generation_s, time/training_s, time/weight_update_s means; `idle:*` the
bubble fraction of each stage (`Timeline.busy_seconds` over the timed
iterations); `cpu:this` / `cpu:gen` the cores' worth of CPU that this
process (trainer; colocated: trainer + engine) and the generator actor used
over the timed iterations (1.0 = a whole core): well below 1 on a busy stage
means the machine's other load took its core.

Writes under `--out` (default experiments/out/bench_modes): one
timeline_<mode>.json per mode (`Timeline.to_json`; labels "gen k", "train k",
"epochs k" name iteration k), timeline_<mode>.png of each mode's last block,
timeline_all.png (experiments/plot_timeline.py) and summary.json.

Ends with
  RESULT colocated=1.00 sync=<x> stream=<x> async=<x> pipeline_efficiency=<x>
         async_partial=<x> partial_vs_async=<x>
         async_partial_sibling=<x> sibling_vs_async=<x>
         [<mode>_trained_tokens_per_s=<x> ... ranker_recall20=<x>]
(mode throughputs in samples/s / colocated's; efficiency = async /
min(generation alone, training alone); the partial and sibling keys when that
arm runs; the bracketed ones with an environment, where a sample is a
trajectory, trained tokens are the policy's and the ranker's recall@20 is on
trajectory length).

The agentic workload (multi-turn trajectories with the calculator, a slow
tool standing in for a search API or code runner):

  python experiments/bench_modes.py --config=agentic \
      --override=env.extra_tool_latency_s=0.2 --modes=colocated,async,async_partial
"""

import json
import os
import re
import statistics
import time

# The colocated engine runs in this process (as the Ray actors run theirs):
# no engine-core process, fast start-up. Set before vLLM is imported.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from absl import app, flags, logging as absl_logging  # noqa: E402

from streamrl.workload import (
    MODES,
    Workload,
    config_json,
    describe,
    make_settings,  # noqa: E402
    now,
    precompile,
    train_alone,
    with_mode,
)

_QUICK = flags.DEFINE_bool("quick", False, "Tiny workload (16 prompts, 2 blocks), for development.")
_WORKDIR = flags.DEFINE_string(
    "workdir", "/tmp/streamrl_bench_modes", "Cache of the warm-started policy."
)
_OUT = flags.DEFINE_string(
    "out",
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "bench_modes"),
    "Where timelines, PNGs and summary.json go.",
)
_MODES = flags.DEFINE_list("modes", list(MODES), "Modes to run.")
_BLOCKS = flags.DEFINE_integer(
    "blocks", 2, "Blocks: every arm runs once per block, in rotating order."
)
_WARMUP = flags.DEFINE_integer("warmup", 1, "Untimed iterations at the start of each arm's block.")
_ITERATIONS = flags.DEFINE_integer("iterations", 8, "Timed iterations per arm and block.")
_PROMPTS = flags.DEFINE_integer("prompts", None, "trainer.prompts_per_iteration (config's: 64).")
_MINI = flags.DEFINE_integer(
    "mini_batch", None, "trainer.mini_batch_size (= micro_batch_size; config's: 32 and 8)."
)
_MAX_NUM_SEQS = flags.DEFINE_integer(
    "max_num_seqs", None, "engine.max_num_seqs: requests in flight per instance."
)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", None, "sampling.max_tokens (config's: 320).")
_PPO_EPOCHS = flags.DEFINE_integer("ppo_epochs", None, "trainer.ppo_epochs (config's: 2).")
_CONFIG = flags.DEFINE_string(
    "config",
    "ppo",
    "The workload: configs/<name>.py (ppo, grpo, agentic: multi-turn trajectories with the "
    "calculator tool; env.extra_tool_latency_s stands in for a slow tool).",
)
_OVERRIDES = flags.DEFINE_multi_string(
    "override", [], "Extra config overrides, key=value (configs/ppo.py keys)."
)
_PLOT = flags.DEFINE_bool("plot", True, "Draw the timeline PNGs.")
_LOG_COMPILES = flags.DEFINE_bool(
    "log_compiles", False, "Log every JAX compile after the precompile step."
)
_COLOC_THREADS = flags.DEFINE_integer(
    "colocated_engine_threads",
    1,
    "torch threads of colocated's in-process engine (its JAX trainer uses both cores either way).",
)


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


def load_config():
  prompts, mini, blocks = _PROMPTS.value, _MINI.value, _BLOCKS.value
  warm, iters = _WARMUP.value, _ITERATIONS.value
  if _QUICK.value:
    prompts, mini, blocks, warm, iters = 16, 8, 2, 1, 1
  # One more iteration than run: async starts generating the next batch
  # during the last timed iteration, as in steady state. Same value in every
  # mode (it sets the lr decay horizon).
  s = make_settings(
      prompts=prompts,
      mini_batch=mini,
      num_iterations=blocks * (warm + iters) + 1,
      max_num_seqs=_MAX_NUM_SEQS.value,
      max_tokens=_MAX_TOKENS.value,
      extra={"trainer.ppo_epochs": _PPO_EPOCHS.value} if _PPO_EPOCHS.value else None,
      overrides=_OVERRIDES.value,
      config_name=_CONFIG.value,
  )
  return s, blocks, warm, iters


# ------------------------------------------------------------------ the arms
class Arm:
  """One mode: its trainer, loader and measurements across blocks.

  Each block builds the mode's rollout (in-process engine or Ray actor),
  loads the arm's current weights into it the way a resumed run does
  (`rollout.update(trainer.export_weights(), next iteration).wait()`), sets
  the mode up over it (`train.setup_mode`), runs its iterations through
  `train.train_iteration` and closes everything, so only one engine holds
  memory at a time. Every arm has a trainer of its own.
  """

  def __init__(self, work: Workload, mode: str):
    self.mode, self.work = mode, work
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
    rollout = self.work.rollout(s, engine_threads=_COLOC_THREADS.value)
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
  updates); the Flax->HF weight export is timed apart.
  """

  def __init__(self, work: Workload):
    self.work = work
    self.s = with_mode(work.s, "sync")
    self.trainer = work.trainer(self.s)
    self.rewarder = work.rewarder()
    self.loader = work.loader()
    self.next_it = 0
    self.gen = {"samples": 0, "wall_s": 0.0, "cpu": 0.0}
    self.train = {"samples": 0, "wall_s": 0.0, "cpu": 0.0, "export_s": 0.0}
    self.digest_it0 = None

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
        generated.append((it, samples, by_id))
        self.next_it += 1
    finally:
      svc.close()
    for j, (it, samples, by_id) in enumerate(generated):
      t0, c0 = now(), time.process_time()
      train_alone(
          self.trainer,
          self.rewarder,
          [samples],
          by_id,
          it=it,
          ppo_epochs=s.trainer.ppo_epochs,
          seed=s.seed,
          copy=False,
      )
      t1, c1 = now(), time.process_time()
      self.trainer.export_weights()
      t2 = now()
      if j >= untimed:
        self.train["samples"] += len(samples)
        self.train["wall_s"] += t1 - t0
        self.train["cpu"] += c1 - c0
        self.train["export_s"] += t2 - t1

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


# ------------------------------------------------------------------- report
def save_timeline(res: dict, out_dir: str) -> str:
  from streamrl.pipeline.timeline import Timeline  # pylint: disable=g-import-not-at-top

  tl = Timeline()
  for stage, start, end, label in res["timeline"]:
    tl.add(stage, start, end, label)
  path = os.path.join(out_dir, f"timeline_{res['mode']}.json")
  origin = res["windows"][0][1]
  tl.to_json(path, origin=origin)
  res["timeline_json"] = path
  res["origin"] = origin
  return path


def main(argv):
  del argv
  absl_logging.set_verbosity(absl_logging.WARNING)
  import logging  # pylint: disable=g-import-not-at-top

  logging.getLogger("streamrl").setLevel(logging.WARNING)
  s, blocks, warm, iters = load_config()
  modes = list(_MODES.value)
  for m in modes:
    if m not in MODES:
      raise app.UsageError(f"--modes has {m!r}; use some of {', '.join(MODES)}.")
  os.makedirs(_OUT.value, exist_ok=True)
  os.makedirs(_WORKDIR.value, exist_ok=True)
  t_all = now()
  print(
      f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start", flush=True
  )
  print(
      f"workload: {describe(s)}; {blocks} blocks of {warm} untimed + {iters} timed iterations "
      "per arm",
      flush=True,
  )
  work = Workload(s, _WORKDIR.value)
  precompile(work, [with_mode(s, m) for m in modes + ["sync"]], blocks * (warm + iters) + 1)
  arms = {m: Arm(work, m) for m in modes}
  alone = AloneArms(work)
  if _LOG_COMPILES.value:
    import jax  # pylint: disable=g-import-not-at-top

    jax.config.update("jax_log_compiles", True)
    absl_logging.set_verbosity(absl_logging.INFO)

  for b in range(blocks):
    order = modes[b % len(modes) :] + modes[: b % len(modes)]
    print(
        f"--- block {b + 1}/{blocks}: {', '.join(order)}, alone "
        f"(load {os.getloadavg()[0]:.1f}, rss {rss_gib():.1f} GiB)",
        flush=True,
    )
    for mode in order:
      arms[mode].run_block(warm + iters, warm)
    alone.run_block(warm + iters, warm)
  results = {m: arms[m].result() for m in modes}
  gen, trn = alone.results()

  tput = {m: results[m]["samples_per_s"] for m in modes}
  tput["gen_alone"], tput["train_alone"] = gen["samples_per_s"], trn["samples_per_s"]
  base = tput.get("colocated")
  limit = min(tput["gen_alone"], tput["train_alone"])

  # Table.
  stages = sorted({st for m in modes for st in results[m]["bubbles"]})
  head = (
      f"{'mode':11s} {'samples/s':>9s} {'vs coloc':>8s} {'gen s':>6s} {'train s':>7s} "
      f"{'push s':>6s} "
      + " ".join(f"{'idle:' + st:>15s}" for st in stages)
      + f" {'staleness':>9s} {'cpu:this':>8s} {'cpu:gen':>7s} {'it0 digest':>10s}"
  )
  print("\n" + head)
  print("-" * len(head))
  for m in modes:
    r = results[m]
    ratio = f"{tput[m] / base:8.2f}" if base else f"{'-':>8s}"
    print(
        f"{m:11s} {tput[m]:9.2f} {ratio} {r['generation_s']:6.2f} {r['training_s']:7.2f} "
        f"{r['weight_update_s']:6.2f} "
        + " ".join(f"{r['bubbles'].get(st, 1.0):15.2f}" for st in stages)
        + f" {r['staleness_mean']:9.2f} {r['cpu_this']:8.2f} {r['cpu_gen']:7.2f} "
        f"{r['digest_it0']:>10s}"
    )
  for k, name, res, cpu_k in (
      ("gen_alone", "gen alone", gen, "cpu_gen"),
      ("train_alone", "train alone", trn, "cpu_this"),
  ):
    ratio = f"{tput[k] / base:8.2f}" if base else f"{'-':>8s}"
    extra = f"  it0 digest {gen['digest_it0']}" if k == "gen_alone" else ""
    print(f"{name:11s} {tput[k]:9.2f} {ratio}   {cpu_k}={res[cpu_k]:.2f}{extra}")
  print(
      f"train alone with the Flax->HF weight export: {trn['samples_per_s_with_export']:.2f} samples/s"
  )
  # CPU work per iteration does not depend on how much of a core the
  # machine's other load left us: it shows where work grew, not time.
  print(
      "CPU seconds per timed iteration (this process / generator actor): "
      + "; ".join(
          f"{m} {results[m]['cpu_s_per_iteration'][0]:.2f}/{results[m]['cpu_s_per_iteration'][1]:.2f}"
          for m in modes
      )
      + f"; gen alone -/{gen['cpu_s_per_iteration']:.2f}; "
      f"train alone {trn['cpu_s_per_iteration']:.2f}/-"
  )
  print(
      "per timed iteration samples/s (median, min-max): "
      + "; ".join(
          f"{m} {statistics.median(v):.0f} ({min(v):.0f}-{max(v):.0f})"
          for m, v in ((m, results[m]["samples_per_s_per_iteration"]) for m in modes)
      )
  )
  loads = [x for m in modes for x in results[m]["load"]]
  print(f"load average during the blocks: {min(loads):.1f}-{max(loads):.1f} (2 cores)")

  # Timelines: the whole run per mode; the pictures show the last block.
  summary = {
      "config": config_json(s),
      "throughput": tput,
      "modes": {},
      "gen_alone": gen,
      "train_alone": trn,
  }
  for m in modes:
    res = results[m]
    save_timeline(res, _OUT.value)
    # The last block's timed iterations (its untimed first one, on a fresh
    # engine, is slow and would squeeze the rest), with a margin before.
    last_timed = res["timed"][-iters:]
    span = last_timed[-1][2] - last_timed[0][1]
    res["plot_window"] = (
        max(last_timed[0][1] - 0.15 * span, res["windows"][-(warm + iters)][1]) - res["origin"],
        last_timed[-1][2] - res["origin"],
    )
    res["timed_windows"] = [(i, s - res["origin"], e - res["origin"]) for i, s, e in res["timed"]]
    summary["modes"][m] = {
        k: v for k, v in res.items() if k not in ("timeline", "windows", "timed")
    }
  with open(os.path.join(_OUT.value, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1, default=str)
  if _PLOT.value:
    from experiments import plot_timeline  # pylint: disable=g-import-not-at-top

    pngs = plot_timeline.plot_summary(_OUT.value)
    for p in pngs:
      print(f"timeline picture: {p}")
  print(f"total {now() - t_all:.0f} s, load average {os.getloadavg()[0]:.1f} at end", flush=True)

  fmt = lambda m: f"{tput[m] / base:.2f}" if (base and m in tput) else "nan"
  eff = tput["async"] / limit if "async" in tput else float("nan")
  # Each arm trains its own policy, and on the work traces the policies drift
  # apart in length: response tokens per second, next to samples per second.
  tok = {m: results[m]["tokens_per_s"] for m in modes}
  if "colocated" in tok:
    print(
        "response tokens/s vs colocated: "
        + ", ".join(f"{m} {tok[m] / tok['colocated']:.2f}" for m in modes),
        flush=True,
    )
  agentic = ""
  if s.env.enabled:
    # A sample is a trajectory; trained tokens are the policy's (observations are masked).
    for m in modes:
      r = results[m]
      print(
          f"agentic {m}: {tput[m]:.2f} trajectories/s, {r['policy_tokens_per_s']:.1f} trained "
          f"tokens/s, {r['env_turns_mean']:.2f} turns/trajectory, engine idle on tools "
          f"{r['env_engine_idle_s']:.2f} s/iteration, ranker recall@20 on trajectory length "
          f"{r['ranker_recall20']:.2f} (oracle 1.00, random order 0.20)",
          flush=True,
      )
    agentic = " " + " ".join(
        f"{m}_trained_tokens_per_s={results[m]['policy_tokens_per_s']:.1f}" for m in modes
    )
    recalls = [results[m]["ranker_recall20"] for m in modes]
    recalls = [r for r in recalls if r == r]
    agentic += f" ranker_recall20={statistics.fmean(recalls) if recalls else float('nan'):.2f}"
  partial = ""
  if "async_partial" in tput:
    vs_async = tput["async_partial"] / tput["async"] if "async" in tput else float("nan")
    partial = f" async_partial={fmt('async_partial')} partial_vs_async={vs_async:.2f}"
  if "async_partial_sibling" in tput:
    vs_async = tput["async_partial_sibling"] / tput["async"] if "async" in tput else float("nan")
    partial += (
        f" async_partial_sibling={fmt('async_partial_sibling')} sibling_vs_async={vs_async:.2f}"
    )
  print(
      f"RESULT colocated={fmt('colocated')} sync={fmt('sync')} stream={fmt('stream')} "
      f"async={fmt('async')} pipeline_efficiency={eff:.2f}{partial}{agentic}"
  )
  import ray  # pylint: disable=g-import-not-at-top

  if ray.is_initialized():
    ray.shutdown()


if __name__ == "__main__":
  app.run(main)
