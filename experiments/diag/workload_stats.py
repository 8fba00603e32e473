r"""The output lengths a task's warm-started policy really produces.

  python experiments/diag/workload_stats.py [--config=configs/ppo.py] [--workdir=/tmp/streamrl_workload]
      [--prompts=128] [--samples=8] [--override=task.kind=trace ...] [--quick]

Warm-starts the config's tiny policy (cached in --workdir, as a run caches
it), then samples `--samples` responses for each of `--prompts` training
prompts on a real vLLM engine in this process, at the training temperature,
and reports what the trainer and the generators would see:

  p50, p99, max          output tokens (EOS included) over all samples
  p99_over_p50           the long tail across the batch (goal for the default
                         workload: >= 8, max >= 256)
  cv_within              median over prompts of the coefficient of variation
                         of their samples' lengths (goal >= 0.3: lengths vary
                         between samples of one prompt, as reasoning traces do)
  truncated              share of samples cut at sampling.max_tokens
  accuracy               share of samples whose verified answer is right

and the same for the task's own distribution (what the warm-up teaches; for
work traces `tasks.sample_trace`), so a gap between the two is visible.
--quick: 8 prompts, 2 samples each. Ends with

  RESULT p50=.. p99=.. max=.. p99_over_p50=.. cv_within=.. truncated=.. accuracy=..
"""

from absl import app, flags
import numpy as np

from experiments import harness

harness.engines_in_process()

_PROMPTS = flags.DEFINE_integer("prompts", 128, "Training prompts to sample.")
_SAMPLES = flags.DEFINE_integer("samples", 8, "Samples per prompt.")
_SHOW = flags.DEFINE_integer("show", 0, "Print this many of the longest responses.")


def length_report(groups: list[list[int]], max_tokens: int) -> dict:
  """Statistics of per-prompt groups of output lengths (tokens, EOS included)."""
  flat = np.asarray([n for g in groups for n in g], np.float64)
  p50, p99 = np.percentile(flat, [50, 99])
  cvs = [np.std(g) / np.mean(g) for g in groups if len(g) > 1 and np.mean(g) > 0]
  return {
      "p50": float(p50),
      "p99": float(p99),
      "max": float(flat.max()),
      "p99_over_p50": float(p99 / max(p50, 1.0)),
      "cv_within": float(np.median(cvs)) if cvs else float("nan"),
      "truncated": float(np.mean(flat >= max_tokens)),
  }


def main(argv):
  del argv
  from streamrl.trainer import setup
  from streamrl.data import tasks

  s = harness.settings("configs/ppo.py")
  n_prompts, n_samples = (8, 2) if harness.QUICK.value else (_PROMPTS.value, _SAMPLES.value)
  train_examples, _ = setup.load_examples(s)
  # The warm-start cache, as a run keeps it.
  model_dir = setup.policy_dir(s, harness.workdir("/tmp/streamrl_workload"), train_examples)
  tokenizer = setup.make_tokenizer(s, model_dir)
  examples = train_examples[:n_prompts]
  samples, by_id, groups, correct = harness.sample_groups(
      s, model_dir, tokenizer, examples, n_samples
  )
  policy = length_report(groups, s.sampling.max_tokens)
  policy["accuracy"] = float(np.mean(correct))
  lengths = np.asarray([len(x.token_ids) for x in samples])
  # Is a long response a worse one? Accuracy by length quartile.
  edges = np.percentile(lengths, [25, 50, 75])
  quart = np.searchsorted(edges, lengths, side="right")
  print(
      "accuracy by length quartile: "
      + " ".join(
          f"q{q + 1}(<= {lengths[quart == q].max()} tokens)={np.mean(np.asarray(correct)[quart == q]):.3f}"
          for q in range(4)
          if np.any(quart == q)
      )
  )
  for j in np.argsort(-lengths)[: _SHOW.value]:
    x = samples[j]
    print(
        f"{len(x.token_ids):4d} tokens, {by_id[x.prompt_id].prompt!r}: {tokenizer.decode(x.token_ids)!r}"
    )

  # The taught responses in the policy's tokens (a real tokenizer merges
  # characters), with the tokenizer's work unit.
  trace, work = setup.trace_config(s), tasks.work_unit(s.model.tokenizer)
  rng = np.random.default_rng(s.seed)
  taught = [
      [
          len(tokenizer.encode_text(tasks.sft_target(ex, rng, trace, work))) + 1
          for _ in range(n_samples)
      ]
      for ex in examples
  ]
  target = length_report(taught, s.sampling.max_tokens)
  print(f"task.kind={s.task.kind} prompts={len(examples)} samples/prompt={n_samples}")
  print(f"{'':10s}" + "".join(f"{k:>14s}" for k in policy))
  print(f"{'policy':10s}" + "".join(f"{v:14.3f}" for v in policy.values()))
  print(f"{'taught':10s}" + "".join(f"{v:14.3f}" for v in target.values()))
  harness.report(summary={"taught": target}, **{k: f"{v:.3f}" for k, v in policy.items()})


if __name__ == "__main__":
  app.run(main)
