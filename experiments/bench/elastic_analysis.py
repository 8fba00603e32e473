"""The elastic run read back and replayed: its metrics, elastic decisions and
TensorBoard histograms (`analyse_run`), the generator-alone batches against
the simulator (`with_request_cost`, `sharing_check`), the simulator's replay
of the whole run (`predict`), and the per-iteration tables.
"""

from __future__ import annotations

import math
import os
import statistics

from experiments.bench.elastic_setup import log, read_jsonl


def gen_model(profile: dict, cap: int):
  from streamrl.sim.calibrate import from_measured  # pylint: disable=g-import-not-at-top

  gen, _ = from_measured(
      profile, {"fwd_s_per_token": 0.0, "upd_s_per_token": 0.0}, max_num_seqs=cap
  )
  return gen


def replay(profile: dict, b: dict, cap: int, cores: int | None = None) -> float:
  """The simulator's time for generator-alone batch `b` (its lengths, round-robin
  over its instances as the service plans a FIFO round)."""
  from streamrl.sim.generation import simulate_generation  # pylint: disable=g-import-not-at-top

  n, m = len(b["output_lens"]), b["instances"]
  return simulate_generation(
      gen_model(profile, cap),
      m,
      b["prompt_lens"],
      b["output_lens"],
      queues=[list(range(i, n, m)) for i in range(m)],
      caps=[cap] * m,
      cores=cores,
  ).makespan


def with_request_cost(costs: dict, alone: dict, cap: int) -> tuple[dict, float, float]:
  """The PTL profile plus a per-request cost, as experiments/sim/calibrate_sim.py
  derives it: the profile's two-length slope cancels whatever does not scale
  with decode steps (request set-up, the first step, output processing, the
  sample's trip through Ray to the trainer), so each one-instance
  generator-alone batch is replayed with the profile alone, and the median
  difference per request is that cost. The simulator charges it with the
  prefill, per prompt token (exact on average over the batch's prompts).
  A negative difference means the profile's short timings (well under a
  second here) caught a slow moment of this shared machine: the profile is
  then scaled down to the batches instead (PTL and prefill alike).
  Returns (profile, seconds per request, the scale: 1 unless scaled)."""
  one = alone["one"]
  profile = dict(costs["profile"])
  per_request = [(b["gen_s"] - replay(profile, b, cap)) / len(b["output_lens"]) for b in one]
  req, scale = statistics.median(per_request), 1.0
  if req >= 0:
    mean_prompt = statistics.fmean(p for b in one for p in b["prompt_lens"])
    profile["prefill_s_per_token"] += req / mean_prompt
  else:
    scale = statistics.median(b["gen_s"] / replay(profile, b, cap) for b in one)
    profile["ptl_s"] = [scale * x for x in profile["ptl_s"]]
    profile["prefill_s_per_token"] *= scale
  return profile, req, scale


def sharing_check(alone: dict, profile: dict, cap: int, gen_cores: int) -> dict:
  """The generator-alone batches on one and on two instances, measured and
  replayed with the run's cost model (two instances on `gen_cores` cores):
  how far the simulator's time-sharing model is from the node, with and
  without the added instance's first round (its engine is cold)."""
  one = alone["one"]
  # Batch k uses sampling seed k on either count: the same requests, the same lengths.
  cold, warm = alone["two"][0], alone["two"][1:]
  one_sim = [replay(profile, b, cap) for b in one]
  two_sim = [replay(profile, b, cap, gen_cores) for b in warm]
  # What time-sharing costs over the simulator's perfect sharing: the two
  # instances' error over the one instance's (the profile's own error cancels).
  share = statistics.median(b["gen_s"] / x for b, x in zip(warm, two_sim)) / statistics.median(
      b["gen_s"] / x for b, x in zip(one, one_sim)
  )
  return {
      "one_s": [b["gen_s"] for b in one],
      "one_sim_s": one_sim,
      "two_cold_s": cold["gen_s"],
      "two_s": [b["gen_s"] for b in warm],
      "two_sim_s": two_sim,
      "share_cost": max(1.0, share),
      "two_over_one": statistics.median(w["gen_s"] / o["gen_s"] for w, o in zip(warm, one)),
      "cold_over_two": cold["gen_s"] / statistics.median(b["gen_s"] for b in warm),
      # What the added instance's first round costs over the later ones
      # (SimConfig.added_round_s): a fresh engine is slow at first.
      "added_round_s": max(0.0, cold["gen_s"] - statistics.median(b["gen_s"] for b in warm)),
      "add_s": alone["add_s"],
      "placement": alone.get("placement", {}),
  }


def read_histograms(run_dir: str, tags) -> dict[str, dict[int, object]]:
  """{tag: {step: HistogramValue}} from the run's TensorBoard event files."""
  from tensorboard.backend.event_processing import (  # pylint: disable=g-import-not-at-top
      event_accumulator as ea,
  )

  acc = ea.EventAccumulator(run_dir, size_guidance={ea.HISTOGRAMS: 0})
  acc.Reload()
  have = set(acc.Tags().get(ea.HISTOGRAMS, []))
  return {
      t: {e.step: e.histogram_value for e in acc.Histograms(t)} if t in have else {} for t in tags
  }


def _buckets(h):
  """(left, right, count) of a TensorBoard histogram (numpy's [left, right) bins)."""
  lefts = [-math.inf] + list(h.bucket_limit[:-1])
  return [(lo, hi, int(n)) for lo, hi, n in zip(lefts, h.bucket_limit, h.bucket) if n]


def count_outside(h, lo: int, hi: int) -> int:
  """Samples of an integer-valued histogram outside [lo, hi]."""
  if h.min >= lo and h.max <= hi:
    return 0
  bad = sum(n for left, right, n in _buckets(h) if left >= hi + 0.5 or right <= lo - 0.5)
  return max(bad, 1)  # min or max is outside: at least that one sample


def integer_values(h) -> list[int]:
  """The integers a histogram of integer values holds, rebuilt bucket by
  bucket (a bucket spanning several integers spreads its count over them)."""
  out = []
  for left, right, n in _buckets(h):
    first = math.ceil(max(left, h.min))
    last = min(math.ceil(right) - 1, math.floor(h.max))
    if last < first:  # an integer exactly on the top edge (numpy closes the last bin)
      first = last = int(round(right))
    span = last - first + 1
    out.extend(first + (k * span) // n for k in range(n))
  return out


# ----------------------------------------------------------------- analysis
def analyse_run(run_dir: str, s, warmup: int) -> dict:
  rows = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if "samples/count" in r]
  rows.sort(key=lambda r: r["step"])
  events = read_jsonl(os.path.join(run_dir, "elastic.jsonl"))
  hists = read_histograms(run_dir, ("response_length", "staleness"))
  expected = s.samples_per_iteration
  by_step = {r["step"]: r for r in rows}
  bound = (0, s.pipeline.max_staleness) if s.pipeline.mode == "async" else (0, 0)
  lost = duplicated = version_errors = from_summary = 0
  its = []
  for it in range(s.trainer.num_iterations):
    r = by_step.get(it + 1)
    if r is None:
      lost += expected
      continue
    n = int(r["samples/count"])
    lost += max(0, expected - n)
    duplicated += int(r["samples/duplicated"])
    h = hists["staleness"].get(it + 1)
    if h is not None:
      bad = count_outside(h, *bound)
    else:  # no histogram: the summary says whether any sample was outside
      bad = int(r["staleness/max"] > bound[1])
      from_summary += 1
    version_errors += bad
    lens = None
    hl = hists["response_length"].get(it + 1)
    if hl is not None:
      lens = [max(1, v) for v in integer_values(hl)]
    its.append(
        {
            "it": it,
            "samples": n,
            "instances": int(r["generators/instances"]),
            "gen_s": r["time/generation_s"],
            "train_s": r["time/training_s"],
            "push_s": r["time/weight_update_s"],
            "iter_s": r["time/iteration_s"],
            "wall_time": r["wall_time"],
            "mean_len": r["response_length/mean"],
            "output_lens": lens,
            "stale_outside": bad,
        }
    )
  for prev, cur in zip(its, its[1:]):
    # Wall time between two metrics rows beyond the later iteration's own time:
    # the policy's change (an added instance's start-up), the scalars, the checkpoint.
    cur["gap_s"] = cur["wall_time"] - prev["wall_time"] - cur["iter_s"]
  window = [x for x in its if x["it"] >= warmup]
  samples = sum(x["samples"] for x in window)
  out = {
      "iterations": its,
      "events": events,
      "lost": lost,
      "duplicated": duplicated,
      "version_errors": version_errors,
      "instances_start": its[0]["instances"] if its else 0,
      # The most at once: an iteration's count, or a change's (one made after
      # the last iteration shows only in elastic.jsonl).
      "instances_max": max(
          [x["instances"] for x in its] + [e["instances"] for e in events], default=0
      ),
      "instances_end": its[-1]["instances"] if its else 0,
      "window": [warmup, s.trainer.num_iterations],
      # Iterations whose version errors come from staleness/max (no histogram).
      "staleness_from_summary": from_summary,
  }
  if window:
    out["samples_per_s"] = samples / sum(x["iter_s"] for x in window)
    start = its[warmup - 1]["wall_time"] if warmup > 0 and len(its) >= warmup else None
    if start is not None and len(window) == len(its) - warmup:
      out["wall_samples_per_s"] = samples / (window[-1]["wall_time"] - start)
    out["push_s_median"] = statistics.median(x["push_s"] for x in window)
  return out


def policy_kwargs(s) -> dict:
  """ElasticPolicy's keywords from the run's settings, as ElasticPolicy.from_settings
  maps them (every constructor keyword that names an `elastic.*` field)."""
  import inspect  # pylint: disable=g-import-not-at-top
  from streamrl.elastic.policy import ElasticPolicy  # pylint: disable=g-import-not-at-top

  names = inspect.signature(ElasticPolicy.__init__).parameters
  out = {n: getattr(s.elastic, n) for n in names if hasattr(s.elastic, n)}
  return {"start_instances": s.engine.num_instances, **out}


def predict(
    slots: int,
    measured: dict,
    costs: dict,
    profile: dict,
    s,
    gen_cores: int,
    warmup: int,
    share_cost: float,
    added_round_s: float = 0.0,
) -> dict:
  from streamrl.sim.calibrate import predict_elastic_throughput  # pylint: disable=g-import-not-at-top

  its = measured["iterations"]
  if len(its) != s.trainer.num_iterations or any(x["output_lens"] is None for x in its):
    raise RuntimeError("the run's per-iteration output lengths are incomplete; nothing to replay.")
  return predict_elastic_throughput(
      profile,
      costs["trainer"],
      s.pipeline.mode,
      output_lens=None,
      output_lens_per_iteration=[x["output_lens"] for x in its],
      prompt_lens=max(1, round(costs["generation"]["mean_prompt_len"])),
      batch_size=s.samples_per_iteration,
      policy_kwargs=policy_kwargs(s),
      gen_cores=gen_cores,
      share_cost=share_cost,
      max_in_flight=s.engine.max_num_seqs,
      num_minibatches=s.samples_per_iteration // s.trainer.mini_batch_size,
      transfer_s=measured["push_s_median"],
      iterations=s.trainer.num_iterations,
      warmup=warmup,
      seed=s.seed,
      free_slots=lambda it, n: max(0, slots - n) if s.elastic.enabled else 0,
      scheduler=s.scheduler.kind if s.scheduler.kind in ("fifo", "skew") else "fifo",
      ranker_refresh_s=ranker_refresh_s(costs, s),
      added_round_s=added_round_s,
  )


def ranker_refresh_s(costs: dict, s) -> float:
  """The ranker's refresh on the generators' core after each round: measured by
  launch/measure.py when the run's skew scheduler refreshes it there."""
  if s.scheduler.kind != "skew" or s.scheduler.ranker_side != "generators":
    return 0.0
  return float(costs.get("ranker", {}).get("refresh_s", 0.0))


def print_table(measured: dict, pred: dict | None, warmup: int) -> None:
  head = (
      f"{'it':>3s} | {'inst':>4s} {'gen s':>6s} {'train s':>7s} {'push s':>6s} {'iter s':>6s} "
      f"{'gap s':>6s} {'len':>5s} {'other':>5s} | {'inst':>4s} {'gen s':>6s} {'train s':>7s} "
      f"{'iter s':>6s}"
  )
  log(f"\n{'':3s}   {'measured (the run)':<54s} | predicted (simulator)")
  log(head)
  log("-" * len(head))
  for x in measured["iterations"]:
    j = x["it"]
    p = ""
    if pred is not None and j < len(pred["instances"]):
      p = (
          f"{pred['instances'][j]:4d} {pred['gen_s'][j]:6.2f} {pred['train_s'][j]:7.2f} "
          f"{pred['iteration_s'][j]:6.2f}"
      )
    gap = f"{x['gap_s']:6.1f}" if "gap_s" in x else f"{'':6s}"
    other = f"{x['others']:5.2f}" if x.get("others") is not None else f"{'':5s}"
    log(
        f"{j:3d}{'*' if j < warmup else ' '}| {x['instances']:4d} {x['gen_s']:6.2f} "
        f"{x['train_s']:7.2f} {x['push_s']:6.2f} {x['iter_s']:6.2f} {gap} {x['mean_len']:5.1f} "
        f"{other} | {p}"
    )
  log(
      "  * warm-up, not measured. gen s / train s: time/generation_s (first request -> last\n"
      "  sample) and time/training_s (trainer busy); iter s: time/iteration_s (generation +\n"
      "  training + push; the simulator's: previous training end -> this one's, the push\n"
      "  first); gap s: wall time between iterations outside iter s (the policy, an added\n"
      "  instance's start-up and catch-up, checkpoint); len: mean output length (exact);\n"
      "  other: cores that other jobs on this machine kept busy during the iteration."
  )


def print_decisions(measured: dict, pred: dict | None) -> None:
  log("\ndecisions of the run (elastic.jsonl):")
  if not measured["events"]:
    log("  none")
  for e in measured["events"]:
    delta = {"added": +1, "removed": -1}.get(e["action"], 0)
    log(
        f"  after it {e['iteration']}: {delta:+d} ({e['action']}) -> {e['instances']}: {e['reason']}"
    )
  if pred is None:
    return
  log("decisions of the simulator (same ElasticPolicy, simulated stage times):")
  if not pred["decisions"]:
    log("  none")
  for d in pred["decisions"]:
    log(
        f"  after it {d['iteration']}: {d['delta']:+d} -> {d['instances']} (first round "
        f"{d['first_round']}): {d['reason']}"
    )
