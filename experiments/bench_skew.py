"""Skewness-aware generation on a real vLLM long-tail workload: FIFO vs ranker vs oracle.

  python experiments/bench_skew.py [--workdir=/tmp/streamrl_skew] [--quick]

What runs (everything real, on this machine):
  1. Policy: the tiny Qwen2-style model, warmed up with supervised steps
     (streamrl.trainer.sft) on the run configs' work traces (`--task=trace`,
     the default: a random number of passes over the input before the
     answer, so lengths vary between samples of a prompt as well as across
     prompts) or on the plain string tasks (`--task=synthetic`: the length
     follows the prompt). Cached in the workdir.
  2. Length history: the policy generates for `--train_prompts` prompts;
     (prompt ids, generated length) pairs go to <workdir>/length_pairs.jsonl,
     as the RL loop will save them.
  3. Rankers: one per loss (mse / pairwise / both) trained on those pairs;
     recall of the longest 20/10/5 % and Spearman rho measured on the
     benchmark prompts (never trained on) against their real lengths. For
     traces, the same metrics of the exact expected length of the trace
     distribution the warm-up taught (`expected`): the best any predictor
     that sees only the prompt can do against one sampled length.
  4. Latency profile PTL(BS) of the instance (streamrl.generator.profiler).
  5. The benchmark: `--num_prompts` new prompts, each sampled
     `--group_size` times (a GRPO group; every sample its own seed), on
     `--num_instances` instances, each at most `--max_batch_size` in flight, under
       fifo      random order, round-robin (mean over --fifo_orders shuffles),
       lpt_only  the first fifo assignment, each instance admitting longest-predicted first,
       ranker    ranker predictions -> Algorithm 2 (makespan objective) -> LPT,
       ranker_sum  the same with the paper's sum objective,
       ranker_sim  ranker, makespan objective, latency_model="simulate" (ours)
                 with the ranker's real error: the ranks and lengths of the
                 history's second half under a ranker trained on its first,
       grouped   ranker, makespan, each prompt's samples on one instance, LPT,
       sibling   the grouped plan, each instance admitting one sample per prompt
                 first, then by the lengths of finished and running siblings
                 blended with the ranker's estimate (scheduler.sibling_lengths=on),
       oracle    true lengths -> Algorithm 2 (makespan) -> LPT,
       oracle_sim  true lengths, latency_model="simulate" (exact ranks).
     Sampling is seeded per prompt, so every arm generates the same tokens.

How time is measured: the instances of one plan run one after another through
one in-process vLLM engine; each instance's time is its own measured run, and
the plan's makespan is the largest (the instances would run in parallel on
their own resources). The clock is this process's CPU time by default
(`--clock=cpu`; the engine runs in-process with one compute thread), because
on a shared 2-core machine wall time mostly measures the neighbours; wall-time
ratios are printed too. Within every repetition the same instance slot of all
plans runs back to back; an instance's time is the minimum over repetitions
(the uncontended estimate, for all plans alike) and a plan's makespan is its
slowest instance. Ratios are makespan(arm) / makespan(fifo). A third,
noise-free column ("trace") replays each run's real engine steps through the
measured profile: sum over steps of PTL(requests in flight).

Ends with
  RESULT fifo=1.00 ranker=<x> oracle=<x> recall20=<x> recall10=<x> recall5=<x> spearman=<x> ...

Measured results: experiments/RESULTS.md (section bench_skew.py).
"""

import json
import os
import statistics
import time

# One compute thread, engine in this process: stable CPU-time measurements on
# a shared machine (set before torch / vLLM are imported).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from absl import app, flags  # noqa: E402

_WORKDIR = flags.DEFINE_string(
    "workdir", "/tmp/streamrl_skew", "Cache for policy, pairs, rankers, profile."
)
_QUICK = flags.DEFINE_bool(
    "quick", False, "Small everything, for development (explicit flags win)."
)
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 128, "Benchmark prompts.")
_GROUP_SIZE = flags.DEFINE_integer(
    "group_size", 4, "Samples per prompt (a GRPO group; each with its own seed)."
)
_NUM_INSTANCES = flags.DEFINE_integer("num_instances", 4, "Generator instances.")
_MAX_BS = flags.DEFINE_integer("max_batch_size", 32, "Most requests in flight per instance.")
_REPS = flags.DEFINE_integer("reps", 11, "Timed repetitions of every (plan, instance).")
_TRAIN_PROMPTS = flags.DEFINE_integer(
    "train_prompts", 3000, "Prompts generated for the length history."
)
_SFT_STEPS = flags.DEFINE_integer("sft_steps", 300, "Supervised warm-up steps of the policy.")
_RANKER_STEPS = flags.DEFINE_integer("ranker_steps", 1000, "Training steps per ranker.")
_RANKER_LOSS = flags.DEFINE_enum(
    "ranker_loss", "mse", ["mse", "pairwise", "both"], "Ranker used for dispatch."
)
_LOSSES = flags.DEFINE_list(
    "compare_losses", ["mse", "pairwise", "both"], "Rankers trained and compared."
)
_TASK = flags.DEFINE_enum(
    "task", "trace", ["trace", "synthetic"], "Work traces (the run configs') or string tasks."
)
_MAX_ANSWER = flags.DEFINE_integer(
    "max_answer_len", None, "Longest task answer (default: 48 for traces, 96 for strings)."
)
_TRACE_MAX_TOKENS = flags.DEFINE_integer(
    "trace_max_tokens", 320, "sampling.max_tokens for traces (the warm-up's fit 0.9 of it)."
)
_ALPHA = flags.DEFINE_float("alpha", 0.2, "Long-tail fraction for Algorithm 2.")
_CLOCK = flags.DEFINE_enum("clock", "cpu", ["cpu", "wall"], "Which time the makespan ratios use.")
_FIFO_ORDERS = flags.DEFINE_integer(
    "fifo_orders", 3, "Random FIFO orders averaged for the baseline."
)
_SEED = 0


def _traces() -> bool:
  return _TASK.value == "trace"


def _max_answer() -> int:
  return _MAX_ANSWER.value or (48 if _traces() else 96)


def _task_kwargs():
  return dict(max_answer_len=_max_answer(), median_len=4.0, sigma=1.0)


def _trace_config():
  """The trace distribution the warm-up teaches (as configs/ppo.py's), or None."""
  from streamrl.data import tasks

  if not _traces():
    return None
  return tasks.TraceConfig(max_tokens=int(0.9 * _TRACE_MAX_TOKENS.value))


def _max_tokens() -> int:
  return _TRACE_MAX_TOKENS.value if _traces() else _max_answer() + 16


def build_policy(workdir: str) -> str:
  """Tiny policy warmed up on the tasks; cached by (steps, task settings)."""
  import numpy as np
  from flax import nnx

  from streamrl.data import tasks
  from streamrl.data import tokenizer as tok
  from streamrl.models import config, tiny
  from streamrl.models.transformer import Transformer
  from streamrl.trainer.sft import warm_start

  path = os.path.join(workdir, "policy")
  trace = _trace_config()
  meta = {
      "sft_steps": _SFT_STEPS.value,
      "task": _task_kwargs(),
      "trace": str(trace),
      "trace_format": tasks.TRACE_FORMAT,
  }
  meta_path = os.path.join(path, "bench_skew_meta.json")
  if os.path.exists(meta_path) and json.load(open(meta_path)) == meta:
    return path
  examples = tasks.make_examples(4000, seed=100, **_task_kwargs())
  if trace is not None:
    examples = tasks.add_traces(examples, trace)
  rng = np.random.default_rng(_SEED)
  pairs = [
      (
          [tok.BOS_ID] + tok.encode(e.prompt),
          tok.encode(tasks.sft_target(e, rng, trace)) + [tok.EOS_ID],
      )
      for e in examples
  ]
  cfg = config.tiny_qwen2(tok.VOCAB_SIZE)
  t0 = time.perf_counter()
  model, loss = warm_start(
      Transformer(cfg, rngs=nnx.Rngs(_SEED)),
      pairs,
      steps=_SFT_STEPS.value,
      batch_size=32,
      lr=3e-3,
      seq_len=max(len(p) + len(r) for p, r in pairs),
  )
  print(
      f"[bench] policy warm-up: {_SFT_STEPS.value} steps, loss {loss:.3f}, "
      f"{time.perf_counter() - t0:.0f}s",
      flush=True,
  )
  tiny.build_tiny_model_dir(path, cfg, model=model)
  json.dump(meta, open(meta_path, "w"))
  return path


def generate_lengths(gen, prompts, sampling) -> dict[int, int]:
  return {
      s.prompt_id: len(s.token_ids)
      for s in gen.generate(prompts, sampling, seed=_SEED, max_in_flight=_MAX_BS.value)
  }


def length_history(workdir, gen, sampling) -> list:
  """(prompt ids, length) pairs of the policy on training prompts; cached JSONL."""
  from streamrl.data import tasks
  from streamrl.data.loader import make_prompts
  from streamrl.ranker import data as rdata

  path = os.path.join(workdir, "length_pairs.jsonl")
  if os.path.exists(path):
    pairs = rdata.load_pairs(path)
    if len(pairs) >= _TRAIN_PROMPTS.value:
      return pairs[: _TRAIN_PROMPTS.value]
    os.remove(path)
  prompts = make_prompts(
      tasks.make_examples(_TRAIN_PROMPTS.value, seed=1, first_id=1_000_000, **_task_kwargs())
  )
  t0 = time.perf_counter()
  lengths = generate_lengths(gen, prompts, sampling)
  print(
      f"[bench] length history: {len(prompts)} prompts, {sum(lengths.values())} tokens, "
      f"{time.perf_counter() - t0:.0f}s",
      flush=True,
  )
  pairs = [(tuple(ids), lengths[pid]) for pid, ids in prompts]
  rdata.append_pairs(path, pairs)
  return pairs


def train_ranker(workdir, loss, pairs):
  """A RankerTrainer for `loss`, restored from the workdir when already trained."""
  from configs import ranker as ranker_config
  from streamrl.ranker import data as rdata
  from streamrl.ranker.train import RankerTrainer

  vocab_size, fp = rdata.char_tokenizer_fingerprint()
  rdir = os.path.join(workdir, f"ranker_{loss}_{_RANKER_STEPS.value}_{len(pairs)}")
  if os.path.isdir(os.path.join(rdir, "checkpoints")):
    return RankerTrainer.restore(rdir, vocab_size=vocab_size, tokenizer_fingerprint=fp)
  cfg = ranker_config.get_config()
  cfg.loss = loss
  trainer = RankerTrainer(cfg, vocab_size=vocab_size, tokenizer_fingerprint=fp, workdir=rdir)
  t0 = time.perf_counter()
  trainer.fit(pairs, _RANKER_STEPS.value)
  trainer.save()
  print(
      f"[bench] ranker {loss}: {_RANKER_STEPS.value} steps, {time.perf_counter() - t0:.0f}s",
      flush=True,
  )
  return trainer


class StepTrace:
  """Records how many requests are in flight at every engine step of `gen`.

  Registered as the instance's step callback. Summing PTL(in flight) over the
  steps of a run gives its time under the measured latency profile: a
  noise-free companion to the measured time that still reflects the engine's
  real admission and finishing order.
  """

  def __init__(self, gen):
    self.counts = []
    gen.set_step_callback(self._record)

  def _record(self, in_flight: int) -> None:
    self.counts.append(in_flight)


def replay(plan, lengths, profile, hints=None, shared=False):
  """The plan's makespan replayed step by step through the profile: every
  instance admits up to its cap (in plan order, or with `hints` through a
  SiblingQueue), each step of n running requests takes PTL(n), and the
  instances advance together in time, so with `shared` every instance sees
  every sibling's progress as it happens (which the real runs here, one
  instance after another, cannot show)."""
  import collections
  import heapq

  from streamrl.scheduling.siblings import SiblingQueue

  n = plan.num_instances
  queues = [
      SiblingQueue(list(a), [hints[p] for p in a]) if hints else collections.deque(a)
      for a in plan.assignments
  ]
  running = [{} for _ in range(n)]  # request -> tokens so far
  clock, end = [(0.0, i) for i in range(n)], [0.0] * n
  while clock:
    t, i = heapq.heappop(clock)
    while queues[i] and len(running[i]) < plan.batch_sizes[i]:
      running[i][queues[i].popleft()] = 0
    if not running[i]:
      end[i] = t
      continue
    t += profile.ptl(len(running[i])) + profile.context_s_per_token * sum(running[i].values())
    for p in list(running[i]):
      running[i][p] += 1
      done = running[i][p] >= lengths[p]
      if hints:
        for q in queues if shared else [queues[i]]:
          (q.finished if done else q.running)(hints[p], running[i][p])
      if done:
        del running[i][p]
    heapq.heappush(clock, (t, i))
  return max(end)


def run_instance(gen, trace, prompts_by_id, ids, batch_size, sampling, profile, hints=None):
  """Generates `ids` (in order, at most batch_size in flight) on `gen`; with
  `hints` (id -> LengthHint), in the sibling-aware order instead.

  Returns (cpu s, wall s, profile-weighted step-trace s, {prompt id: length}).
  """
  import gc

  lengths = {}
  trace.counts = []
  gc.collect()
  gc.disable()  # A collection inside a 0.3 s run is a 10 % outlier.
  try:
    c0, w0 = time.process_time(), time.perf_counter()
    reqs = [(i, prompts_by_id[i]) + ((None, hints[i]) if hints else ()) for i in ids]
    for s in gen.generate(reqs, sampling, seed=_SEED, max_in_flight=batch_size):
      lengths[s.prompt_id] = len(s.token_ids)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
  finally:
    gc.enable()
  return cpu, wall, sum(profile.ptl(n) for n in trace.counts if n > 0), lengths


def main(argv):
  del argv
  if _QUICK.value:
    for flag, value in (
        ("num_prompts", 32),
        ("reps", 2),
        ("train_prompts", 600),
        ("sft_steps", 100),
        ("ranker_steps", 200),
        ("compare_losses", ["mse"]),
    ):
      if not flags.FLAGS[flag].present:  # flags given explicitly win
        flags.FLAGS[flag].value = value
  import numpy as np

  from streamrl.data import tasks
  from streamrl.data.loader import make_prompts
  from streamrl.generator.config import Sampling
  from streamrl.generator.profiler import profile_instance
  from streamrl.generator.vllm_engine import GeneratorInstance
  from streamrl.ranker.metrics import ranking_metrics
  from streamrl.scheduling import DispatchPlan, LatencyProfile, dispatch, fifo_plan, lpt_order
  from streamrl.scheduling.dispatch import rank_quantiles
  from streamrl.scheduling.scheduler import with_length_hints

  # Everything cached depends on the policy, hence on these two settings.
  workdir = os.path.join(_WORKDIR.value, f"{_TASK.value}_ans{_max_answer()}_sft{_SFT_STEPS.value}")
  os.makedirs(workdir, exist_ok=True)
  n_inst, max_bs = _NUM_INSTANCES.value, _MAX_BS.value
  policy = build_policy(workdir)
  sampling = Sampling(temperature=1.0, top_p=1.0, max_tokens=_max_tokens())
  gen = GeneratorInstance(
      policy,
      max_num_seqs=max(64, max_bs),
      max_model_len=max(320, _max_tokens() + 2 * _max_answer() + 16),
      seed=_SEED,
      kv_cache_gib=1.0,
  )

  pairs = length_history(workdir, gen, sampling)
  recent = np.asarray([n for _, n in pairs], np.float64)

  prof_path = os.path.join(workdir, f"profile_{_CLOCK.value}.json")
  profile = LatencyProfile.from_json(prof_path) if os.path.exists(prof_path) else None
  if profile is None or not profile.context_s_per_token:  # measured before the context term
    clock = time.process_time if _CLOCK.value == "cpu" else time.perf_counter
    profile = profile_instance(
        gen,
        [1, 2, 4, 8, 16, 32, 64],
        reps=3,
        clock=clock,
        name=f"tiny-qwen2 vllm-cpu 1 thread ({_CLOCK.value} time)",
        path=prof_path,
    )

  examples = tasks.make_examples(_NUM_PROMPTS.value, seed=2, first_id=0, **_task_kwargs())
  # Request k samples prompt k // group_size (its own seed: sampling seed + k).
  group_size = _GROUP_SIZE.value
  groups = [k // group_size for k in range(len(examples) * group_size)]
  unique = make_prompts(examples)
  prompts = [(k, unique[g][1]) for k, g in enumerate(groups)]
  prompts_by_id = dict(prompts)
  assert list(prompts_by_id) == list(range(len(prompts)))
  # Untimed warm-up: the true lengths (same tokens in every arm: per-prompt seeds).
  true = generate_lengths(gen, prompts, sampling)
  true_len = np.asarray([true[i] for i in range(len(prompts))], np.float64)

  rankers = {
      loss: train_ranker(workdir, loss, pairs)
      for loss in dict.fromkeys(_LOSSES.value + [_RANKER_LOSS.value])
  }
  preds = {loss: r.predict([ids for _, ids in prompts]) for loss, r in rankers.items()}
  rank_metrics = {loss: ranking_metrics(p, true_len) for loss, p in preds.items()}
  trace = _trace_config()
  if trace is not None:
    # The prompt-only bound: the exact mean of the taught trace distribution.
    expected = [
        tasks.expected_response_length(
            tasks.parse_prompt(examples[g].prompt)[1], examples[g].answer, trace
        )
        for g in groups
    ]
    rank_metrics["expected"] = ranking_metrics(np.asarray(expected), true_len)
  pred = preds[_RANKER_LOSS.value]
  # The simulate model's rank history, as a run records it (out of sample):
  # a ranker trained on the history's first half ranks its second half. The
  # oracle's ranks are exact.
  half = len(pairs) // 2
  held = train_ranker(workdir, _RANKER_LOSS.value, pairs[:half])
  rank_history = list(
      zip(rank_quantiles(held.predict([ids for ids, _ in pairs[half:]])), recent[half:])
  )
  oracle_history = list(zip(rank_quantiles(recent), recent))

  fifo_plans = {
      f"fifo{k}": fifo_plan(len(prompts), n_inst, max_bs, seed=_SEED + 1 + k)
      for k in range(_FIFO_ORDERS.value)
  }
  base = fifo_plans["fifo0"]
  lpt_only = DispatchPlan(
      assignments=tuple(tuple(a[j] for j in lpt_order(pred[list(a)])) for a in base.assignments),
      batch_sizes=base.batch_sizes,
      n_long_instances=0,
      predicted_time=float("nan"),
      objective="lpt_only",
  )

  def alg2(lengths, **kw):
    return dispatch(
        lengths, n_inst, profile, recent, alpha=_ALPHA.value, max_batch_size=max_bs, **kw
    )

  grouped = alg2(pred, groups=groups)
  hints = {r.id: r.hint for r in with_length_hints(prompts, groups, grouped.lengths)}
  hinted = {"sibling"}  # arms that run with length hints
  plans = {
      **fifo_plans,
      "lpt_only": lpt_only,
      "ranker": alg2(pred),
      "ranker_sum": alg2(pred, objective="sum"),
      "ranker_sim": alg2(pred, latency_model="simulate", rank_history=rank_history),
      # Group-aware: a prompt's samples on one instance; "grouped" admits them
      # in plain LPT order, "sibling" in the sibling-aware order
      # (streamrl/scheduling/siblings.py: one per prompt first, then by what
      # the finished and running siblings say, blended with the ranker's estimate).
      "grouped": grouped,
      "sibling": grouped,
      "oracle": alg2(true_len),
      "oracle_sim": alg2(true_len, latency_model="simulate", rank_history=oracle_history),
  }
  # Identical plans (e.g. both objectives choosing the same split) run once.
  aliases = {}
  for a in list(plans):
    same = next(
        (
            b
            for b in plans
            if b != a
            and b not in aliases
            and not {a, b} & hinted
            and plans[b].assignments == plans[a].assignments
            and plans[b].batch_sizes == plans[a].batch_sizes
            and list(plans).index(b) < list(plans).index(a)
        ),
        None,
    )
    if same:
      aliases[a] = same
  names = [a for a in plans if a not in aliases]
  trace = StepTrace(gen)
  # times[plan][instance][clock] -> one value per repetition.
  times = {a: [{"cpu": [], "wall": [], "trace": []} for _ in range(n_inst)] for a in names}
  mismatched = 0
  for rep in range(_REPS.value):
    for inst in range(n_inst):
      # The same instance slot of every plan back to back (rotating which goes
      # first), so drifting load on the machine hits all plans alike.
      k = (rep * n_inst + inst) % len(names)
      for a in names[k:] + names[:k]:
        cpu, wall, modelled, lengths = run_instance(
            gen,
            trace,
            prompts_by_id,
            plans[a].assignments[inst],
            plans[a].batch_sizes[inst],
            sampling,
            profile,
            hints if a in hinted else None,
        )
        mismatched += sum(lengths[i] != true[i] for i in lengths)
        times[a][inst]["cpu"].append(cpu)
        times[a][inst]["wall"].append(wall)
        times[a][inst]["trace"].append(modelled)
    print(f"[bench] rep {rep + 1}/{_REPS.value} done", flush=True)

  def makespan(a, clock):
    # Min over repetitions estimates each instance's uncontended time; the
    # plan's makespan is its slowest instance.
    return max(min(times[a][i][clock]) for i in range(n_inst))

  for a, same in aliases.items():
    times[a] = times[same]

  clocks = ("cpu", "wall", "trace")
  arms = ["fifo"] + [a for a in plans if not a.startswith("fifo")]
  med = {a: {c: makespan(a, c) for c in clocks} for a in plans}
  # Random FIFO: the mean over its random orders.
  med["fifo"] = {c: statistics.mean(med[f][c] for f in fifo_plans) for c in clocks}
  plans["fifo"] = base
  rel = {a: {c: med[a][c] / med["fifo"][c] for c in clocks} for a in list(plans)}
  ratio = {a: rel[a][_CLOCK.value] for a in arms}

  print()
  print(
      f"policy: tiny qwen2 + {_SFT_STEPS.value} SFT steps; task={_TASK.value} "
      f"max_answer_len={_max_answer()}; "
      f"sampling T=1.0 max_tokens={sampling.max_tokens}, per-prompt seeds"
  )
  p50, p90, p99 = np.percentile(true_len, [50, 90, 99])
  print(
      f"workload: {len(examples)} prompts x {group_size} samples, generated length p50={p50:.0f} p90={p90:.0f} p99={p99:.0f} "
      f"max={true_len.max():.0f} (history: {len(pairs)} pairs, p50={np.percentile(recent, 50):.0f} "
      f"p90={np.percentile(recent, 90):.0f}); {n_inst} instances, max {max_bs} in flight; "
      f"{mismatched} length mismatches across arms"
  )
  print(
      "PTL(BS) ms: "
      + " ".join(f"{b}:{1e3 * t:.2f}" for b, t in zip(profile.batch_sizes, profile.ptl_s))
      + f"; prefill {1e6 * profile.prefill_s_per_token:.1f} us/token"
  )
  print(f"{'ranker loss':12s} {'recall20':>8s} {'recall10':>8s} {'recall5':>8s} {'spearman':>8s}")
  for loss, m in rank_metrics.items():
    print(
        f"{loss:12s} {m['recall20']:8.3f} {m['recall10']:8.3f} {m['recall5']:8.3f} {m['spearman']:8.3f}"
    )
  print(
      f"makespan = max over instances of min over {_REPS.value} repetitions; fifo = mean of "
      f"{len(fifo_plans)} random orders"
  )
  print(
      "ratio = makespan / fifo's; cpu: process CPU time, wall: wall time, trace: sum of PTL(in flight)"
      " over the engine steps of each run (noise-free); alg2 s: Algorithm 2's own estimate"
  )
  print(
      f"{'arm':12s} {'cpu s':>6s} {'cpu':>6s} {'wall':>6s} {'trace':>6s} {'N_long':>6s} {'alg2 s':>7s}  batch caps"
  )
  for a in arms + list(fifo_plans):
    plan = plans[a]
    note = f"  (same plan as {aliases[a]})" if a in aliases else ""
    print(
        f"{a:12s} {med[a]['cpu']:6.3f} {rel[a]['cpu']:6.3f} {rel[a]['wall']:6.3f} {rel[a]['trace']:6.3f} "
        f"{plan.n_long_instances:6d} {plan.predicted_time:7.3f}  {list(plan.batch_sizes)}{note}"
    )
  # The replay (noise-free, instances in parallel): the bound of admission
  # order (oracle) and siblings shared between instances (sibling_shared: the
  # ranker's plan, siblings spread over instances, each seeing all of them).
  spread_hints = {r.id: r.hint for r in with_length_hints(prompts, groups, plans["ranker"].lengths)}
  fifo_r = statistics.mean(replay(plans[f], true_len, profile) for f in fifo_plans)
  rep = {
      "ranker": replay(plans["ranker"], true_len, profile),
      "grouped": replay(grouped, true_len, profile),
      "sibling": replay(grouped, true_len, profile, hints),
      "sibling_shared": replay(plans["ranker"], true_len, profile, spread_hints, shared=True),
      "oracle": replay(plans["oracle"], true_len, profile),
      "ranker_sim": replay(plans["ranker_sim"], true_len, profile),
      # simulate without a rank history trusts the ranker's order as exact
      "ranker_sim_exact": replay(alg2(pred, latency_model="simulate"), true_len, profile),
  }
  print("replay / fifo's: " + " ".join(f"{a}={t / fifo_r:.3f}" for a, t in rep.items()))
  m = rank_metrics[_RANKER_LOSS.value]
  print(
      f"RESULT fifo=1.00 ranker={ratio['ranker']:.2f} sibling={ratio['sibling']:.2f} "
      f"oracle={ratio['oracle']:.2f} grouped={ratio['grouped']:.2f} "
      f"sibling_trace={rel['sibling']['trace']:.2f} "
      f"replay_ranker={rep['ranker'] / fifo_r:.2f} replay_sibling_shared={rep['sibling_shared'] / fifo_r:.2f} "
      f"recall20={m['recall20']:.2f} recall10={m['recall10']:.2f} recall5={m['recall5']:.2f} "
      f"spearman={m['spearman']:.2f} ranker_sum={ratio['ranker_sum']:.2f} lpt_only={ratio['lpt_only']:.2f} "
      f"ranker_sim={ratio['ranker_sim']:.2f} oracle_sim={ratio['oracle_sim']:.2f} "
      f"ranker_trace={rel['ranker']['trace']:.2f} oracle_trace={rel['oracle']['trace']:.2f} "
      f"ranker_wall={rel['ranker']['wall']:.2f} oracle_wall={rel['oracle']['wall']:.2f}"
      + (f" expected_recall20={rank_metrics['expected']['recall20']:.2f}" if trace else "")
  )


if __name__ == "__main__":
  app.run(main)
