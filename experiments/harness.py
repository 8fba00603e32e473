"""What every script in experiments/ shares: its common flags, its one way to
report, vLLM engines in this process, the tiny policy, CPU pinning.

Every script runs from the checkout either way:

  python experiments/bench/bench_skew.py --quick
  python -m experiments.bench.bench_skew --quick

(the package is installed editable with streamrl; without the install, run the
`-m` form from the checkout's root). The common flags, defined here once so
that a script may import another's functions:

  --config    the run's config file (where the script runs one)
  --override  config overrides key=value (repeatable)
  --model     the policy: "tiny" (the default), "mid" (the benchmark model,
              `MODEL_PRESETS`) or a local HF model directory
  --workdir   scratch and caches (default /tmp/streamrl_<script>)
  --out       where summary.json and figures go (default experiments/out/<script>)
  --reps      timed repetitions (default: the script's own)
  --quick     a small, fast version through the same code paths

`report(**kv)` prints the `RESULT key=value ...` line and writes summary.json.
Nothing here imports vLLM, Ray or ml_collections at import time:
experiments/check/gpu_check.py runs on machines without them.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping, Sequence

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFIG = flags.DEFINE_string("config", None, "The run's config file (default: the script's).")
OVERRIDE = flags.DEFINE_multi_string("override", [], "Config overrides key=value (repeatable).")
MODEL = flags.DEFINE_string(
    "model",
    "",
    "tiny | mid | a local HF model directory (default: tiny; tiny and mid are warm-started in "
    "--workdir).",
)
# The built-in policies --model names, as config overrides. "mid" is the
# benchmark model (a Qwen2 shape with the 32,000-piece SentencePiece tokenizer
# and a ChatML template, bf16 on the generators: streamrl/models/config.py's
# `mid_qwen2`); its warm-up takes smaller batches at a lower learning rate so
# that it stays within minutes on a CPU.
MODEL_PRESETS = {
    "tiny": {},
    "mid": {
        "model.tiny": "qwen2_mid",
        "model.tokenizer": "sentencepiece",
        "model.dtype": "bfloat16",
        "warmstart.steps": 300,
        "warmstart.batch_size": 16,
        "warmstart.lr": 2e-3,
    },
}
WORKDIR = flags.DEFINE_string(
    "workdir", "", "Scratch and cache directory (default: /tmp/streamrl_<script>)."
)
OUT = flags.DEFINE_string(
    "out", "", "Where summary.json and figures go (default: experiments/out/<script>)."
)
REPS = flags.DEFINE_integer("reps", None, "Timed repetitions (default: the script's own).")
QUICK = flags.DEFINE_bool("quick", False, "A small, fast version through the same code paths.")


# ------------------------------------------------------------------- flags
def script() -> str:
  """The running script's name ("bench_skew"), for default directories."""
  return os.path.splitext(os.path.basename(sys.argv[0] or "experiment"))[0]


def workdir(default: str = "") -> str:
  """--workdir, else `default`, else /tmp/streamrl_<script>; created."""
  path = WORKDIR.value or default or os.path.join("/tmp", f"streamrl_{script()}")
  os.makedirs(path, exist_ok=True)
  return path


def out_dir(default: str = "") -> str:
  """--out, else `default`, else experiments/out/<script>; created."""
  path = OUT.value or default or os.path.join(ROOT, "experiments", "out", script())
  os.makedirs(path, exist_ok=True)
  return path


def reps(default: int) -> int:
  """--reps, else the script's `default`."""
  n = default if REPS.value is None else REPS.value
  if n < 1:
    raise app.UsageError(f"--reps={n}: give at least 1.")
  return n


def config_path(default: str) -> str:
  """--config, else `default` (relative to the checkout)."""
  return CONFIG.value or os.path.join(ROOT, default)


def model_overrides() -> dict[str, str]:
  """--model as config overrides: a preset's (`MODEL_PRESETS`), else model.path."""
  if MODEL.value in MODEL_PRESETS:
    return {k: str(v) for k, v in MODEL_PRESETS[MODEL.value].items()}
  return {"model.path": MODEL.value} if MODEL.value else {}


def overrides(extra: Sequence[str] = ()) -> dict[str, str]:
  """`extra`, then --model (`model_overrides`), then --override, as {key:
  value}: the command line wins."""
  out = {}
  model = [f"{k}={v}" for k, v in model_overrides().items()]
  for item in [*extra, *model, *OVERRIDE.value]:
    key, sep, value = item.partition("=")
    if not sep:
      raise app.UsageError(f"--override={item!r} is not key=value.")
    out[key.strip()] = value.strip()
  return out


def override_list() -> list[str]:
  """`overrides()` as "key=value" strings."""
  return [f"{k}={v}" for k, v in overrides().items()]


def settings(default_config: str, script_overrides: Mapping | None = None):
  """The typed settings of --config (else `default_config`) with the script's
  overrides, then `overrides()`, applied."""
  from streamrl import config as config_lib  # pylint: disable=g-import-not-at-top
  from streamrl.config import settings as settings_lib  # pylint: disable=g-import-not-at-top

  config = config_lib.load_config(config_path(default_config))
  config = config_lib.apply_overrides(config, {**(script_overrides or {}), **overrides()})
  return settings_lib.from_config(config)


def main_command(workdir: str, script_overrides: Mapping, config: str = "configs/ppo.py") -> list:
  """The command of a run as a user starts it: launch/main.py with --config
  (else `config`), the workdir and `--config.<key>=<value>` for each of
  `script_overrides` and then of `overrides()` (--model, --override)."""
  cmd = [sys.executable, os.path.join(ROOT, "launch", "main.py")]
  cmd += [f"--config={config_path(config)}", f"--workdir={workdir}"]
  for k, v in {**script_overrides, **overrides()}.items():
    cmd.append(f"--config.{k}={json.dumps(v) if isinstance(v, bool) else v}")
  return cmd


# ------------------------------------------------------------------ report
def _fmt(v) -> str:
  if isinstance(v, bool):
    return str(int(v))
  if isinstance(v, float):
    if math.isfinite(v) and abs(v) >= 1e4:
      return f"{v:.0f}"
    return f"{v:.4g}"
  return str(v)


def report(*, out: str | None = None, summary: Mapping | None = None, **kv) -> str:
  """Prints `RESULT k=v ...` (floats to 4 significant digits; pass a string to
  choose the format) and writes `summary` plus {"result": kv} as summary.json
  under `out` (default: `out_dir()`). Returns the line."""
  line = "RESULT " + " ".join(f"{k}={_fmt(v)}" for k, v in kv.items())
  path = os.path.join(out or out_dir(), "summary.json")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump({**(summary or {}), "result": kv}, f, indent=1, default=str)
  print(line, flush=True)
  return line


# ----------------------------------------------------------------- engines
def engines_in_process(*, threads: int | None = None, bind: str | None = None) -> None:
  """vLLM's engine core in this process (several times faster to start than
  its own process, and its clock is this process's), quiet logs; `threads`
  torch threads per engine, `bind` VLLM_CPU_OMP_THREADS_BIND. Call before
  vLLM is imported; a variable already set wins."""
  if threads is not None:
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
  if bind is not None:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", bind)
  os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
  quiet_engines()


def quiet_engines() -> None:
  """vLLM's warnings only, and no tokenizer thread pools in forked workers."""
  os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
  os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def sample_groups(s, model_dir: str, tokenizer, examples: Sequence, n_samples: int):
  """`n_samples` responses to each of `examples` from one in-process engine of
  `model_dir` (the run's sampling, round 0's seed), scored by the run's
  Rewarder: (samples, {request id: Example}, per-prompt lists of response
  lengths in tokens, per-sample correctness)."""
  from streamrl.data.loader import make_requests  # pylint: disable=g-import-not-at-top
  from streamrl.generator import local  # pylint: disable=g-import-not-at-top
  from streamrl.trainer import setup  # pylint: disable=g-import-not-at-top

  requests, by_id = make_requests(examples, tokenizer, n_samples)
  rollout = local.LocalRollout(model_dir, s.engine, dtype=s.model.dtype, seed=s.seed)
  try:
    samples = list(rollout.generate(requests, s.sampling, seed=local.round_seed(s.seed, 0)))
  finally:
    rollout.close()
  groups: dict[int, list[int]] = {}
  for x in samples:
    groups.setdefault(x.prompt_id // n_samples, []).append(len(x.token_ids))
  _, correct = setup.make_rewarder(s, tokenizer)(samples, by_id)
  return samples, by_id, list(groups.values()), correct


# ------------------------------------------------------------------ policy
def tiny_policy(
    examples: Sequence = (),
    *,
    steps: int = 0,
    seed: int = 0,
    trace=None,
    batch_size: int = 32,
    lr: float = 3e-3,
    max_answer_len: int = 48,
    directory: str = "",
) -> str:
  """--model's directory, else its built-in policy (tiny by default)
  warm-started for `steps` on `examples` (`streamrl.trainer.warmstart.
  prepare_model_dir`: cached in `directory`, default the workdir, under a name
  of what its weights depend on); with steps=0 the random policy. A preset's
  own warm-up settings (`MODEL_PRESETS`) replace `steps`, `batch_size` and `lr`
  when `steps` > 0."""
  from streamrl.data.config import Task  # pylint: disable=g-import-not-at-top
  from streamrl.models.config import Model  # pylint: disable=g-import-not-at-top
  from streamrl.trainer import warmstart  # pylint: disable=g-import-not-at-top
  from streamrl.trainer.config import Warmstart  # pylint: disable=g-import-not-at-top

  preset = model_overrides()
  if steps and "warmstart.steps" in preset:
    steps = int(preset["warmstart.steps"])
    batch_size = int(preset["warmstart.batch_size"])
    lr = float(preset["warmstart.lr"])
  fields = {k.split(".", 1)[1]: v for k, v in preset.items() if k.startswith("model.")}
  warm = Warmstart(steps=steps, batch_size=batch_size, lr=lr, num_examples=max(1, len(examples)))
  return warmstart.prepare_model_dir(
      Model(**fields),
      warm,
      Task(max_answer_len=max_answer_len),
      seed=seed,
      workdir=directory or workdir(),
      train_examples=list(examples),
      trace=trace,
  )


# ---------------------------------------------------------------- pinning
def all_cores() -> set[int]:
  """Every core of the machine, whatever this process is pinned to."""
  return set(range(os.cpu_count() or 1))


def pin(cores) -> None:
  """Runs this process (and what it starts from now on) on `cores`."""
  os.sched_setaffinity(0, set(cores))


def taskset(cmd: list[str], cores) -> list[str]:
  """`cmd` run on `cores` (under taskset), or as it is when `cores` is empty."""
  if not cores:
    return cmd
  return ["taskset", "-c", ",".join(map(str, sorted(cores)))] + cmd


# The common flags are the script's own in its --help (absl lists a main
# module's flags under its sys.argv[0]).
for _name in ("config", "override", "model", "workdir", "out", "reps", "quick"):
  flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[_name])
