r"""How long a warm-started policy's responses are, and how much of that the prompt decides.

  python experiments/diag/length_stats.py --model=mid [--config=configs/grpo.py]
      [--prompts=64] [--samples=8] [--override=task.trace_passes_per_char=0.5 ...] [--quick]

Warm-starts the config's policy (`--model=tiny|mid|<path>`; cached in
--workdir as a run caches it, the build's wall time reported when this call
made it), then samples `--samples` responses for each of `--prompts` held-out
prompts on a vLLM engine in this process, at the config's temperature, and
reports over all samples (output tokens, EOS included):

  p50, p90, p99, max   the length distribution
  prompt_share         the share of length variance the prompt explains:
                       the variance of the per-prompt means, less what the
                       samples' own spread adds to it (mean within-prompt
                       variance / samples), over the total variance
  truncated            share of samples cut at sampling.max_tokens
  well_formed          (work traces) share of samples in the trace's shape:
                       passes of a digit, work units (`tasks.work_unit` of the
                       tokenizer) and `|`, then `#`, letters, EOS
  accuracy             share of samples whose verified answer is right

and the same lengths for what the warm-up teaches (the task's own sampler,
encoded with the policy's tokenizer), so a variant of the task can be sized
before any warm start. --quick: 8 prompts, 4 samples each. Ends with

  RESULT p50=.. p90=.. p99=.. max=.. prompt_share=.. truncated=.. well_formed=.. accuracy=..
      warmstart_s=..
"""

import os
import re
import time

from absl import app, flags
import numpy as np

from experiments import harness

harness.engines_in_process()

_PROMPTS = flags.DEFINE_integer("prompts", 64, "Held-out prompts to sample.")
_SAMPLES = flags.DEFINE_integer("samples", 8, "Samples per prompt (at least 2).")


def trace_pattern(work: str) -> re.Pattern:
  """A finished work trace of `work` units: passes (the passes left, the
  units, PASS_END), WORK_END, the answer."""
  return re.compile(rf"([1-9]{re.escape(work)}+\|)*#[a-z]*")


def length_summary(groups: list[list[int]], max_tokens: int) -> dict:
  """p50/p90/p99/max, the prompt's share of the variance and the truncated
  share of per-prompt groups of lengths (each group >= 2 samples)."""
  flat = np.asarray([n for g in groups for n in g], np.float64)
  p50, p90, p99 = np.percentile(flat, [50, 90, 99])
  k = np.mean([len(g) for g in groups])
  means = np.asarray([np.mean(g) for g in groups])
  within = np.mean([np.var(g, ddof=1) for g in groups])
  total = np.var(flat)
  # Per-prompt means of k samples carry within/k of sampling noise on top
  # of the prompts' own spread (one-way ANOVA's estimate of the latter).
  between = max(np.var(means) - within / k, 0.0)
  return {
      "p50": float(p50),
      "p90": float(p90),
      "p99": float(p99),
      "max": float(flat.max()),
      "prompt_share": float(between / total) if total > 0 else float("nan"),
      "truncated": float(np.mean(flat >= max_tokens)),
  }


def main(argv):
  del argv
  from streamrl.data import tasks
  from streamrl.trainer import setup, warmstart

  s = harness.settings("configs/grpo.py")
  n_prompts, n_samples = (8, 4) if harness.QUICK.value else (_PROMPTS.value, _SAMPLES.value)
  if n_samples < 2:
    raise app.UsageError(f"--samples={n_samples}: the prompt's share needs at least 2.")
  train_examples, eval_examples = setup.load_examples(s)
  workdir = harness.workdir()
  cached = os.path.isdir(
      warmstart.tiny_model_dir(
          s.model, s.warmstart, s.task, seed=s.seed, workdir=workdir, trace=setup.trace_config(s)
      )
  )
  t0 = time.time()
  model_dir = setup.policy_dir(s, workdir, train_examples)
  warmstart_s = float("nan") if cached or s.model.path else time.time() - t0
  tokenizer = setup.make_tokenizer(s, model_dir)
  examples = eval_examples[:n_prompts]
  samples, by_id, groups, correct = harness.sample_groups(
      s, model_dir, tokenizer, examples, n_samples
  )
  policy = length_summary(groups, s.sampling.max_tokens)
  if s.task.kind == "trace":
    texts = [tokenizer.decode(x.token_ids).strip() for x in samples]
    finished = [len(x.token_ids) < s.sampling.max_tokens for x in samples]
    pattern = trace_pattern(tasks.work_unit(s.model.tokenizer))
    shaped = [f and pattern.fullmatch(t) is not None for f, t in zip(finished, texts)]
    policy["well_formed"] = float(np.mean(shaped))
  policy["accuracy"] = float(np.mean(correct))

  trace, work = setup.trace_config(s), tasks.work_unit(s.model.tokenizer)
  rng = np.random.default_rng(s.seed)
  taught = [
      [
          len(tokenizer.encode_text(tasks.sft_target(ex, rng, trace, work))) + 1
          for _ in range(n_samples)
      ]
      for ex in examples
  ]
  target = length_summary(taught, s.sampling.max_tokens)
  for j in sorted(by_id)[: 2 * n_samples : n_samples]:
    x = next(x for x in samples if x.prompt_id == j)
    print(f"{by_id[j].prompt!r} -> {tokenizer.decode(x.token_ids)!r}")
  print(
      f"task.kind={s.task.kind} model={harness.MODEL.value or 'tiny'} held-out prompts="
      f"{len(examples)} samples/prompt={n_samples} temperature={s.sampling.temperature}"
  )
  print(f"{'':8s}" + "".join(f"{k:>14s}" for k in policy))
  print(f"{'policy':8s}" + "".join(f"{v:14.3f}" for v in policy.values()))
  print(f"{'taught':8s}" + "".join(f"{v:14.3f}" for v in target.values()))
  harness.report(
      summary={"taught": target, "model_dir": model_dir},
      **{k: f"{v:.3f}" for k, v in policy.items()},
      warmstart_s=f"{warmstart_s:.0f}",
  )


if __name__ == "__main__":
  app.run(main)
