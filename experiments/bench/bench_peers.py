r"""StreamRL against its peers on the same GRPO job: Hugging Face TRL's
GRPOTrainer and Google's Tunix GRPOLearner.

  pip install -c constraints.txt -e .[peers]   # TRL (not installed by install.sh / CI)
  python experiments/bench/bench_peers.py [--seed=0] [--iterations=90] [--num_eval=512]
      [--systems=streamrl,trl,tunix] [--tunix_python=PATH] [--resume_summary]
      [--workdir=/tmp/streamrl_bench_peers] [--out=experiments/out/bench_peers]

Tunix cannot share StreamRL's environment (its `safetensors<0.8` against our
transformers' `safetensors>=0.8`); without --tunix_python the script creates
a virtualenv for it in <workdir>/tunix-venv on first use (StreamRL editable,
`google-tunix`, constraints.txt but for the pins in
`experiments/bench/peer_tunix.py` TUNIX_PINS; its docstring has the commands).

The job is `configs/grpo.py` (the long-tailed work-trace task; its group
size, prompts per iteration, mini-batch and epochs as `settings_for` checks
them) for --iterations iterations, from one warm-started tiny Qwen2
policy (an HF directory, trained once in --workdir and shared), rewarded by
the same verifier (`task.reward`, partial match of the text after the work
trace). Every system takes the training prompts in StreamRL's order of draw
(its `PromptLoader`, `drawn_examples`), and every peer is given the very
token ids StreamRL's tokenizer makes for them (`peer_prompt`: the ids decoded
without special tokens, which each peer's own tokenizer call turns back into
the same ids; checked on every prompt before training, and in
tests/test_bench_peers.py with the call TRL makes).

  streamrl: `launch/main.py --config=configs/grpo.py` as a user runs it (async
            generation with partial rollouts, ranker, transfer service) on
            both cores, evaluating every --eval_every iterations;
  trl:      `trl.GRPOTrainer` as it runs on CPU (colocated; transformers'
            `generate`; torch on both cores; gradient checkpointing off, as
            the tiny policy fits without it), saving the policy at the same
            points. Matched: group size, prompts per generation, optimizer
            steps per generation (`per_device_train_batch_size`,
            `steps_per_generation`, `num_iterations`), learning rate, warm-up
            and cosine decay to the same floor, AdamW betas and weight decay,
            gradient clip, KL coefficient (k3, in the loss, against the warm
            start), clip range, token-mean loss (`loss_type="dapo"`),
            group-normalised advantages, temperature and top-p, the response
            length cap;
  tunix:    `tunix.rl.grpo.GRPOLearner` with its vanilla JAX sampler, colocated
            on the CPU device (experiments/bench/peer_tunix.py): the policy loaded
            through Tunix's Qwen2 model, StreamRL's optimizer (the same
            optax chain), the same group size, mini-batch, epochs, KL (k3,
            `low_var_kl`), clip range and token-mean loss; its policy
            snapshotted at the same points and exported as HF directories.

What stays unmatched is printed with the results (`TRL_UNMATCHED`,
`peer_tunix.UNMATCHED`) and kept in summary.json. The peers' policies are
evaluated by StreamRL's own held-out evaluation (`evaluation.evaluate`: a vLLM
engine on the saved policy, --num_eval held-out prompts, sampled at
temperature 1 and greedy) after their runs, outside their timing. Reported
per system: samples/s and response tokens/s over the training iterations
(StreamRL: the sum of `time/iteration_s`; TRL: its `train()` minus
checkpoint saving; Tunix: its `train()` minus the snapshots), the start-up
apart (command to first iteration), held-out accuracy at equal samples (the
last point) and at equal training time (the slower system's curve
interpolated at the shorter run's end), with the standard error
sqrt(p (1 - p) / n). One PNG of held-out accuracy against training seconds,
all systems. Ends with

  RESULT streamrl_over_trl_samples_per_s=.. streamrl_over_trl_tokens_per_s=..
         accuracy_delta_trl_equal_samples=.. accuracy_delta_trl_equal_samples_se=..
         accuracy_delta_trl_equal_time=.. trl_samples_per_s=.. trl_acc=..
         streamrl_over_tunix_samples_per_s=.. (the same keys for tunix)
         streamrl_samples_per_s=.. streamrl_acc=.. streamrl_stall_s=..
         streamrl_steady_samples_per_s=.. streamrl_generation_s=..
         streamrl_training_s=.. streamrl_overlap_bound_samples_per_s=..
         streamrl_split_bound_samples_per_s=..

(deltas: StreamRL minus the peer, points of sampled held-out accuracy; a
peer's keys only where it ran or --resume_summary kept it, so
`--systems=streamrl` prints StreamRL's alone). StreamRL's bounds come from
its own run: generation_s and training_s are the generator's and the
trainer's busy seconds summed over the iterations, the overlap bound is the
samples over the larger of the two (each on its own core, perfectly
overlapped), the split bound the samples over their mean (the same work
spread evenly over both cores).
Results: experiments/RESULTS.md and the README.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time

from absl import app, flags

from experiments import harness

ROOT = harness.ROOT

_SEED = flags.DEFINE_integer("seed", 0, "The run's seed (both systems).")
_ITERATIONS = flags.DEFINE_integer("iterations", 90, "GRPO iterations of 128 samples.")
_NUM_EVAL = flags.DEFINE_integer("num_eval", 512, "Held-out prompts per evaluation.")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 30, "Iterations between evaluations.")
_SYSTEMS = flags.DEFINE_list("systems", ["streamrl", "trl", "tunix"], "Which systems to run.")
_TUNIX_PYTHON = flags.DEFINE_string(
    "tunix_python",
    "",
    "Python of a virtualenv with Tunix and StreamRL (default: <workdir>/tunix-venv, created "
    "on first use; experiments/bench/peer_tunix.py).",
)
_REPORT_ONLY = flags.DEFINE_bool(
    "report_only",
    False,
    "Only report: StreamRL's run and the peers' evaluated curves as --workdir and --out hold them.",
)
_RESUME = flags.DEFINE_bool(
    "resume_summary",
    False,
    "Start from --out's summary.json and run only --systems (the others kept as measured).",
)
_CHILD = flags.DEFINE_string("child", "", "Internal: JSON arguments of the TRL run (a subprocess).")

CONFIG = os.path.join(ROOT, "configs", "grpo.py")
GROUP, PROMPTS, MINI, EPOCHS = 4, 32, 64, 2  # configs/grpo.py (checked in `settings_for`)


def overrides(seed: int, iterations: int, num_eval: int, eval_every: int) -> dict:
  return {
      "seed": seed,
      "trainer.num_iterations": iterations,
      "task.num_eval": num_eval,
      "log.eval_every": eval_every,
  }


def settings_for(seed, iterations, num_eval, eval_every):
  from streamrl import config as config_lib
  from streamrl.config import settings

  config = config_lib.apply_overrides(
      config_lib.load_config(CONFIG), overrides(seed, iterations, num_eval, eval_every)
  )
  s = settings.from_config(config)
  got = (
      s.advantage.group_size,
      s.trainer.prompts_per_iteration,
      s.trainer.mini_batch_size,
      s.trainer.ppo_epochs,
  )
  if got != (GROUP, PROMPTS, MINI, EPOCHS):
    raise ValueError(f"configs/grpo.py changed its batch shape to {got}; update bench_peers.py.")
  return s


def stderr(p: float, n: int) -> float:
  return math.sqrt(max(p * (1 - p), 0.0) / max(n, 1))


# ------------------------------------------------------------------ StreamRL
def run_streamrl(s, workdir: str, warm_dir: str, run: bool = True) -> dict:
  """Runs StreamRL (or with `run=False` only reads the run in `workdir`)."""
  run_dir = os.path.join(workdir, "streamrl")
  if run and os.path.isdir(run_dir):  # a run left there would resume from its checkpoint
    shutil.rmtree(run_dir)
  os.makedirs(run_dir, exist_ok=True)
  link = os.path.join(run_dir, os.path.basename(warm_dir))
  if not os.path.exists(link):
    os.symlink(warm_dir, link)
  cmd = harness.main_command(
      run_dir,
      overrides(s.seed, s.trainer.num_iterations, s.task.num_eval, s.log.eval_every),
      config="configs/grpo.py",
  )
  t0 = time.time()
  if run:
    with open(os.path.join(workdir, "streamrl.log"), "w") as log:
      rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc:
      raise RuntimeError(f"the StreamRL run exited {rc}; its log: {workdir}/streamrl.log")
  rows = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl")) if x.strip()]
  its = sorted((r for r in rows if "time/iteration_s" in r), key=lambda r: r["step"])
  train_s = sum(r["time/iteration_s"] for r in its)
  samples = sum(r["samples/count"] for r in its)
  tokens = sum(r["samples/count"] * r["response_length/mean"] for r in its)
  # Iteration k logs at step k; an evaluation at step k follows iterations 1..k.
  elapsed, acc = {0: 0.0}, 0.0
  for r in its:
    acc += r["time/iteration_s"]
    elapsed[r["step"]] = acc
  curve = [
      dict(
          samples=r["step"] * PROMPTS * GROUP,
          train_s=elapsed[r["step"]],
          acc=r["eval/accuracy"],
          acc_greedy=r.get("eval/accuracy_greedy"),
      )
      for r in rows
      if r.get("eval/accuracy") is not None
  ]
  # Iterations over 3 x the median: the trainer compiling for a new padded
  # length (XLA) when ~/.cache/streamrl/xla lacks it, and other stalls.
  median = sorted(r["time/iteration_s"] for r in its)[len(its) // 2]
  steady = [r for r in its if r["time/iteration_s"] <= 3 * median]
  first_it = min(r["wall_time"] for r in its) - its[0]["time/iteration_s"]
  if not run:  # the command's start: the run directory's oldest file
    t0 = min(os.path.getmtime(os.path.join(run_dir, f)) for f in os.listdir(run_dir))
  return dict(
      samples_per_s=samples / train_s,
      tokens_per_s=tokens / train_s,
      train_s=train_s,
      startup_s=first_it - t0,
      wall_s=time.time() - t0,
      curve=curve,
      stalls=len(its) - len(steady),
      stall_s=train_s - sum(r["time/iteration_s"] for r in steady),
      steady_samples_per_s=sum(r["samples/count"] for r in steady)
      / sum(r["time/iteration_s"] for r in steady),
      time_split={
          k: sum(r.get(f"time/{k}_s", 0.0) for r in its)
          for k in ("generation", "training", "weight_update", "generation_wait")
      },
  )


# ------------------------------------------------------------- both peers
def drawn_examples(s) -> list:
  """The training examples in the order StreamRL's loader draws them, one
  iteration's prompts after another (both peers take them in this order)."""
  from streamrl.trainer import setup
  from streamrl.data.loader import PromptLoader

  train_examples, _ = setup.load_examples(s)
  loader = PromptLoader(train_examples, PROMPTS, seed=s.seed)
  return [ex for _ in range(s.trainer.num_iterations) for ex in next(loader)]


def peer_prompt(hf_tok, prompt_ids: list[int]) -> str:
  """The text a peer is given for StreamRL's prompt ids: their decoding
  without special tokens, since each peer's tokenizer call adds the `<bos>`
  back (TRL: `trl_prompt_ids`; Tunix: its sampler's `tokenize`)."""
  return hf_tok.decode(prompt_ids, skip_special_tokens=True)


def trl_prompt_ids(processing_class, prompts: list[str]) -> list[list[int]]:
  """The prompt ids TRL 1.16 generates from: `GRPOTrainer._tokenize_prompts`
  for text (not conversational) prompts calls `processing_class(text=prompts)`,
  which adds the tokenizer's special tokens."""
  return processing_class(text=prompts)["input_ids"]


def check_trl_prompts(hf_tok, prompts: list[str], prompt_ids: list[list[int]]) -> None:
  got = trl_prompt_ids(hf_tok, prompts)
  for i, (a, b) in enumerate(zip(got, prompt_ids)):
    if list(a) != list(b):
      raise RuntimeError(f"TRL would tokenize prompt {i} as {a}, StreamRL as {b}: {prompts[i]!r}.")


# What TRL runs unlike StreamRL (printed and kept in the summary).
TRL_UNMATCHED = (
    "generation: TRL generates on-policy with transformers' generate, colocated with training "
    "(StreamRL generates one weight version ahead with vLLM, asynchronously, partial rollouts)",
    "advantages: TRL's group normalisation (scale_rewards='group', its own epsilon)",
    "learning-rate schedule: transformers' cosine_with_min_lr after linear warm-up "
    "(StreamRL: optax warmup_cosine_decay_schedule, the same end points)",
)


# ----------------------------------------------------------------------- TRL
def trl_child(args: dict) -> None:
  """The TRL run, in a process of its own (torch's threads on both cores)."""
  import datasets
  import torch
  import transformers
  import trl

  from streamrl.trainer import setup
  from streamrl.data import verifiers as rewards_lib

  torch.set_num_threads(os.cpu_count() or 2)
  s = settings_for(args["seed"], args["iterations"], args["num_eval"], args["eval_every"])
  examples = drawn_examples(s)
  model_dir, out_dir = args["model_dir"], args["out_dir"]
  tok = setup.make_tokenizer(s, model_dir)
  hf_tok = transformers.AutoTokenizer.from_pretrained(model_dir)
  prompt_ids = [list(tok.encode_prompt(ex.prompt)) for ex in examples]
  prompts = [peer_prompt(hf_tok, ids) for ids in prompt_ids]
  check_trl_prompts(hf_tok, prompts, prompt_ids)
  answers = [ex.answer for ex in examples]
  data = datasets.Dataset.from_dict({"prompt": prompts, "answer": answers})
  answer_of = setup.answer_of(s)
  score = getattr(rewards_lib, s.task.reward)

  def reward(completions, answer, **unused):
    return [score(answer_of(c), a) for c, a in zip(completions, answer)]

  steps_per_it = (PROMPTS * GROUP // MINI) * EPOCHS
  save_every = args["eval_every"] * steps_per_it
  cfg = trl.GRPOConfig(
      output_dir=out_dir,
      seed=args["seed"],
      use_cpu=True,
      bf16=False,
      # TRL turns it on by default; a 0.8M-parameter policy fits without it.
      gradient_checkpointing=False,
      # The rows in StreamRL's order of draw (drawn_examples), taken as they stand.
      shuffle_dataset=False,
      num_generations=GROUP,
      per_device_train_batch_size=MINI,
      steps_per_generation=PROMPTS * GROUP // MINI,
      num_iterations=EPOCHS,
      max_steps=args["iterations"] * steps_per_it,
      learning_rate=s.optimizer.lr,
      lr_scheduler_type="cosine_with_min_lr",
      lr_scheduler_kwargs={"min_lr_rate": s.optimizer.min_lr_ratio},
      warmup_steps=s.optimizer.warmup_steps,
      adam_beta1=s.optimizer.b1,
      adam_beta2=s.optimizer.b2,
      weight_decay=s.optimizer.weight_decay,
      max_grad_norm=s.optimizer.grad_clip,
      beta=s.kl.coef,
      epsilon=s.loss.clip_low,
      epsilon_high=s.loss.clip_high,
      loss_type="dapo",
      scale_rewards="group",
      temperature=s.sampling.temperature,
      top_p=s.sampling.top_p,
      max_completion_length=s.sampling.max_tokens,
      save_strategy="steps",
      save_steps=save_every,
      save_only_model=True,
      logging_steps=1,
      report_to="none",
      disable_tqdm=True,
  )
  times = {"save_s": 0.0, "saves": {}, "logs": []}

  class Clock(transformers.TrainerCallback):

    def on_train_begin(self, *unused, **kw):
      times["begin"] = time.time()

    def on_save(self, _args, state, *unused, **kw):
      times["saves"][state.global_step] = time.time()

    def on_log(self, _args, state, control, logs=None, **kw):
      times["logs"].append(dict(step=state.global_step, t=time.time(), **(logs or {})))

    def on_train_end(self, *unused, **kw):
      times["end"] = time.time()

  model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
  trainer = trl.GRPOTrainer(
      model=model,
      reward_funcs=reward,
      args=cfg,
      train_dataset=data,
      processing_class=hf_tok,
      callbacks=[Clock()],
  )
  t_start = time.time()
  trainer.train()
  times["startup_s"] = times["begin"] - args["t0"]
  times["wall_s"] = time.time() - args["t0"]
  times["t_start"] = t_start
  with open(os.path.join(out_dir, "times.json"), "w") as f:
    json.dump(times, f)


def run_trl(s, workdir: str, model_dir: str) -> dict:
  out_dir = os.path.join(workdir, "trl")
  os.makedirs(out_dir, exist_ok=True)
  args = dict(
      seed=s.seed,
      iterations=s.trainer.num_iterations,
      num_eval=s.task.num_eval,
      eval_every=s.log.eval_every,
      model_dir=model_dir,
      out_dir=out_dir,
      t0=time.time(),
  )
  with open(os.path.join(workdir, "trl.log"), "w") as log:
    rc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), f"--child={json.dumps(args)}"],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    ).returncode
  if rc:
    raise RuntimeError(f"the TRL run exited {rc}; its log: {workdir}/trl.log")
  times = json.load(open(os.path.join(out_dir, "times.json")))
  steps_per_it = (PROMPTS * GROUP // MINI) * EPOCHS
  saves = {int(k): v for k, v in times["saves"].items()}
  logs = times["logs"]
  # Saving is not training: each save's time (from the step's log to the
  # save) comes off the clock from there on.
  log_t = {r["step"]: r["t"] for r in logs}
  save_cost = {k: max(v - log_t.get(k, v), 0.0) for k, v in saves.items()}
  train_s = times["end"] - times["begin"] - sum(save_cost.values())
  samples = s.trainer.num_iterations * PROMPTS * GROUP
  lengths = [r["completions/mean_length"] for r in logs if "completions/mean_length" in r]
  # One log per optimizer step; a generation's completion lengths come with
  # the first step that trains on it, so this is the mean over generations.
  tokens = samples * (sum(lengths) / max(len(lengths), 1))
  curve = [dict(samples=0, train_s=0.0, dir=model_dir)]
  for step in sorted(saves):
    spent = saves[step] - times["begin"] - sum(c for k, c in save_cost.items() if k <= step)
    curve.append(
        dict(
            samples=step // steps_per_it * PROMPTS * GROUP,
            train_s=spent,
            dir=os.path.join(out_dir, f"checkpoint-{step}"),
        )
    )
  return dict(
      samples_per_s=samples / train_s,
      tokens_per_s=tokens / train_s,
      train_s=train_s,
      startup_s=times["startup_s"],
      wall_s=times["wall_s"],
      curve=curve,
  )


def evaluate_dirs(s, name: str, curve: list[dict], model_dir: str) -> None:
  """Adds StreamRL's held-out accuracy (sampled and greedy) of each saved policy."""
  from streamrl.trainer import evaluation, setup
  from streamrl.generator.local import LocalRollout

  _, evals = setup.load_examples(s)
  tok = setup.make_tokenizer(s, model_dir)
  rewarder = setup.make_rewarder(s, tok)
  try:
    for point in curve:
      rollout = LocalRollout(point["dir"], s.engine, dtype=s.model.dtype, seed=s.seed)
      try:
        m = evaluation.evaluate(rollout, evals, tok, rewarder, s)
      finally:
        rollout.close()
      point["acc"], point["acc_greedy"] = m["accuracy"], m["accuracy_greedy"]
      print(f"  {name} at {point['samples']} samples: {m['accuracy']:.3f} sampled", flush=True)
  finally:
    rewarder.close()


def at_time(curve: list[dict], t: float) -> float:
  """Accuracy at training time `t`, linear between evaluations."""
  pts = sorted((p["train_s"], p["acc"]) for p in curve)
  for (t0, a0), (t1, a1) in zip(pts, pts[1:]):
    if t0 <= t <= t1:
      return a0 + (a1 - a0) * (t - t0) / max(t1 - t0, 1e-9)
  return pts[-1][1] if t > pts[-1][0] else pts[0][1]


def plot(results: dict, path: str, title: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6, 4))
  for name, r in results.items():
    c = r["curve"]
    ax.plot([p["train_s"] for p in c], [p["acc"] for p in c], marker="o", label=name)
  ax.set_xlabel("training seconds (start-up excluded)")
  ax.set_ylabel("held-out accuracy (sampled, T=1)")
  ax.set_title(title, fontsize=9)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def report(results: dict, s, out_dir: str) -> str:
  """Prints the table, the unmatched settings and the RESULT line (returned;
  `harness.report`, summary.json in `out_dir`); writes the plot of every
  system's curve to `out_dir`."""
  n = s.task.num_eval
  print(
      f"\n{'system':<10}{'samples/s':>11}{'tokens/s':>10}{'train s':>9}{'start-up s':>11}  accuracy"
  )
  for name, r in results.items():
    last = r["curve"][-1]
    print(
        f"{name:<10}{r['samples_per_s']:>11.1f}{r['tokens_per_s']:>10.0f}{r['train_s']:>9.0f}"
        f"{r['startup_s']:>11.0f}  {last['acc']:.3f} +- {stderr(last['acc'], n):.3f} sampled, "
        f"{last['acc_greedy']:.3f} greedy (from {r['curve'][0]['acc']:.3f})"
    )
  for name, r in results.items():
    for line in r.get("unmatched", []):
      print(f"unmatched ({name}): {line}")
  if "streamrl" not in results:
    return ""
  a = results["streamrl"]
  png = os.path.join(out_dir, f"accuracy_vs_time_seed{s.seed}.png")
  plot(results, png, f"GRPO, configs/grpo.py, {s.trainer.num_iterations} iterations, seed {s.seed}")
  print(f"plot: {png}")
  print(
      f"StreamRL: {a['stalls']} iterations over 3 x the median (with an empty XLA cache: "
      f"compiles for new padded lengths) took {a['stall_s']:.0f} of its {a['train_s']:.0f} "
      f"training seconds; without them {a['steady_samples_per_s']:.1f} samples/s"
  )
  keys = {}
  for peer in ("trl", "tunix"):
    if peer not in results:
      continue
    b = results[peer]
    t = min(a["train_s"], b["train_s"])
    d_samples = a["curve"][-1]["acc"] - b["curve"][-1]["acc"]
    d_se = math.sqrt(stderr(a["curve"][-1]["acc"], n) ** 2 + stderr(b["curve"][-1]["acc"], n) ** 2)
    d_time = at_time(a["curve"], t) - at_time(b["curve"], t)
    keys.update(
        {
            f"streamrl_over_{peer}_samples_per_s": f"{a['samples_per_s'] / b['samples_per_s']:.2f}",
            f"streamrl_over_{peer}_tokens_per_s": f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}",
            f"accuracy_delta_{peer}_equal_samples": f"{100 * d_samples:.1f}",
            f"accuracy_delta_{peer}_equal_samples_se": f"{100 * d_se:.1f}",
            f"accuracy_delta_{peer}_equal_time": f"{100 * d_time:.1f}",
            f"{peer}_samples_per_s": f"{b['samples_per_s']:.1f}",
            f"{peer}_acc": f"{b['curve'][-1]['acc']:.3f}",
        }
    )
  keys.update(
      streamrl_samples_per_s=f"{a['samples_per_s']:.1f}",
      streamrl_acc=f"{a['curve'][-1]['acc']:.3f}",
      streamrl_stall_s=f"{a['stall_s']:.0f}",
      streamrl_steady_samples_per_s=f"{a['steady_samples_per_s']:.1f}",
  )
  if "time_split" in a:
    samples = a["samples_per_s"] * a["train_s"]
    gen_s, train_s = a["time_split"]["generation"], a["time_split"]["training"]
    keys.update(
        streamrl_generation_s=f"{gen_s:.1f}",
        streamrl_training_s=f"{train_s:.1f}",
        streamrl_overlap_bound_samples_per_s=f"{samples / max(gen_s, train_s, 1e-9):.1f}",
        streamrl_split_bound_samples_per_s=f"{samples / max((gen_s + train_s) / 2, 1e-9):.1f}",
    )
  return harness.report(out=out_dir, summary={"systems": results}, **keys)


def main(argv):
  del argv
  if _CHILD.value:
    trl_child(json.loads(_CHILD.value))
    return
  if "trl" in _SYSTEMS.value and not _REPORT_ONLY.value:
    try:
      import trl  # pylint: disable=unused-import
    except ImportError:
      raise app.UsageError(
          "TRL is not installed; install the peers extra "
          "(pip install -c constraints.txt -e .[peers]) first, or leave it out: --systems=streamrl,tunix."
      ) from None
  from experiments.bench import peer_tunix
  from streamrl.trainer import setup

  s = settings_for(_SEED.value, _ITERATIONS.value, _NUM_EVAL.value, _EVAL_EVERY.value)
  workdir = harness.workdir("/tmp/streamrl_bench_peers")
  out = harness.out_dir()  # summary.json and the PNG
  tunix_python = None
  if "tunix" in _SYSTEMS.value and not _REPORT_ONLY.value:
    tunix_python = _TUNIX_PYTHON.value or peer_tunix.ensure_venv(
        os.path.join(workdir, "tunix-venv")
    )
  train_examples, _ = setup.load_examples(s)
  model_dir = setup.policy_dir(s, workdir, train_examples)
  results = {}
  summary = os.path.join(out, f"summary_seed{s.seed}.json")
  if _REPORT_ONLY.value or _RESUME.value:
    with open(summary) as f:
      results = json.load(f)
  if "streamrl" in _SYSTEMS.value:
    kept = {k: results.get("streamrl", {}).get(k) for k in ("startup_s", "wall_s")}
    results["streamrl"] = run_streamrl(s, workdir, model_dir, run=not _REPORT_ONLY.value)
    if _REPORT_ONLY.value:
      results["streamrl"].update({k: v for k, v in kept.items() if v is not None})
    print(f"streamrl: {json.dumps(results['streamrl'])}", flush=True)
  if not _REPORT_ONLY.value:
    for name in [n for n in _SYSTEMS.value if n in ("trl", "tunix")]:
      print(f"running {name} ...", flush=True)
      if name == "trl":
        results[name] = run_trl(s, workdir, model_dir)
        results[name]["unmatched"] = list(TRL_UNMATCHED)
      else:
        results[name] = peer_tunix.run_tunix(s, workdir, model_dir, tunix_python, _EVAL_EVERY.value)
        results[name]["unmatched"] = list(peer_tunix.UNMATCHED)
      evaluate_dirs(s, name, results[name]["curve"], model_dir)
      print(f"{name}: {json.dumps(results[name])}", flush=True)
      with open(summary, "w") as f:
        json.dump(results, f, indent=2)
  with open(summary, "w") as f:
    json.dump(results, f, indent=2)
  report(results, s, out)


if __name__ == "__main__":
  app.run(main)
