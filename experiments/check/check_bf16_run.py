"""A bf16 checkpoint written by `transformers` through the whole RL run.

  python experiments/check/check_bf16_run.py [--family=qwen2|llama] [--iterations=3] [--workdir=DIR]

Builds the tiny policy (warm-started on the default task, so the run has
something to learn), hands it to `transformers`, which saves it as a
bf16 `Qwen2ForCausalLM` / `LlamaForCausalLM` directory (plus our
tokenizer), and then runs what a user would:

  python launch/main.py --config=configs/ppo.py --config.model.path=DIR \
      --config.model.dtype=bfloat16 --config.trainer.num_iterations=N ...

The generators run vLLM in bf16 and the trainer computes in bf16
(`trainer.compute_dtype=auto` follows `model.dtype`) with fp32 master
weights and an fp32 LM head. Reads `mismatch/*` and `train/ratio_mean` of every iteration from the
run's metrics.jsonl and ends with
`RESULT family=.. iterations=.. k3_kl_max=.. max_abs_logprob_diff_max=.. ratio_mean=..`.
"""

import glob
import json
import os
import shutil
import subprocess
import tempfile

from absl import app, flags

from experiments import harness

_FAMILY = flags.DEFINE_enum("family", "qwen2", ["qwen2", "llama"], "Architecture to save.")
_ITERATIONS = flags.DEFINE_integer("iterations", 3, "RL iterations of the run.")
_MODE = flags.DEFINE_string("mode", "colocated", "pipeline.mode of the run.")


def build_bf16_dir(workdir: str, family: str) -> str:
  """The warm-started tiny policy, saved by transformers in bf16."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top

  from streamrl.config import settings  # pylint: disable=g-import-not-at-top
  from streamrl.trainer import setup  # pylint: disable=g-import-not-at-top

  cfg = settings.default_config()
  cfg.model.tiny = family
  s = settings.from_config(cfg)
  train_examples, _ = setup.load_examples(s)
  fp32_dir = setup.policy_dir(s, workdir, train_examples)
  cls = {"qwen2": transformers.Qwen2ForCausalLM, "llama": transformers.LlamaForCausalLM}[family]
  model = cls.from_pretrained(fp32_dir, torch_dtype=torch.bfloat16)
  out = os.path.join(workdir, f"{family}-bf16")
  model.save_pretrained(out, safe_serialization=True)
  for f in glob.glob(os.path.join(fp32_dir, "*token*")):
    shutil.copy(f, out)
  with open(os.path.join(out, "config.json")) as f:
    saved = json.load(f)
  assert saved.get("torch_dtype", saved.get("dtype")) == "bfloat16", saved
  return out


def main(argv):
  del argv
  workdir = tempfile.mkdtemp(prefix="bf16_run_", dir=harness.workdir())
  model_dir = build_bf16_dir(workdir, _FAMILY.value)
  run_dir = os.path.join(workdir, "run")
  cmd = harness.main_command(
      run_dir,
      {
          "model.path": model_dir,
          "model.dtype": "bfloat16",
          "trainer.num_iterations": _ITERATIONS.value,
          "pipeline.mode": _MODE.value,
          "log.eval_every": 0,
      },
  )
  print(" ".join(cmd), flush=True)
  subprocess.run(cmd, check=True)
  rows = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]
  rows = [r for r in rows if "mismatch/k3_kl" in r]
  for r in rows:
    print(
        f"iteration {r.get('step', '?')}: k3_kl={r['mismatch/k3_kl']:.2e} "
        f"max_abs_logprob_diff={r['mismatch/max_abs_logprob_diff']:.3f} "
        f"ratio_mean={r['train/ratio_mean']:.5f}"
    )
  harness.report(
      family=_FAMILY.value,
      iterations=len(rows),
      k3_kl_max=f"{max(r['mismatch/k3_kl'] for r in rows):.2e}",
      max_abs_logprob_diff_max=f"{max(r['mismatch/max_abs_logprob_diff'] for r in rows):.3f}",
      ratio_mean=f"{sum(r['train/ratio_mean'] for r in rows) / len(rows):.5f}",
  )


if __name__ == "__main__":
  app.run(main)
