r"""The 0.5B recipe on a checkpoint of Qwen2.5-0.5B's shapes: memory and time per phase.

  python experiments/bench/bench_real_model.py --mode=full,lora --iterations=2
  python experiments/bench/bench_real_model.py --quick    # a tiny shape, same path

Writes, under --workdir (no download):

  model/   a checkpoint with Qwen2.5-0.5B-Instruct's shapes, written by
           `transformers` (random bf16 weights: 24 layers, hidden 896, 14 query
           and 2 key/value heads, MLP 4864, vocabulary 151,936, tied
           embeddings), with mistral-common's SentencePiece tokenizer converted
           to an HF tokenizer and a chat template (its pieces are fewer than
           the model's vocabulary, as a real tokenizer's often are);
  gsm8k.jsonl   rows in GSM8K's own format ({"question", "answer": "... #### n"}).

then runs `configs/grpo_qwen0_5b_cpu.py:<mode>` through `launch/main.py` for
--iterations iterations per mode, as a user would. While a run lasts, the
resident memory of every process it started (the launcher, Ray's daemons and
workers, the trainer, generator and reward actors: every process that inherits
this benchmark's tag in its environment) is summed every --sample_s seconds;
the peak of that sum is `peak_rss_gb` (GB, 10^9 bytes), each process kind's
own peak is in the JSON summary. Resident memory counts a page that several
processes map (libraries, a weights file in /dev/shm) in each of them, and a
/dev/shm file no process maps in none, so two more views are sampled:
`peak_pss_shm_gb`, the summed proportional set sizes of anonymous and file
pages (each shared page split among its processes) plus the growth of
/dev/shm (shared memory, counted there once whether mapped or not), and `peak_machine_gb`, the
machine's used memory (MemTotal - MemAvailable) over its value at the start. The phase times are the means over the run's
iterations of time/iteration_s, time/generation_s, time/training_s and
time/weight_update_s in its metrics.jsonl; the exported <workdir>/hf must load
in `transformers`. Ends with one line

  RESULT full_peak_rss_gb=.. full_iteration_s=.. full_generation_s=.. ... lora_...

and summary.json (and each run's memory samples, run_<mode>_memory.jsonl)
under --out. A run that fails prints its last lines and its memory plan (the
table the trainer logs at start) and the benchmark exits non-zero. Not run in CI (tests/test_bench_real_model.py runs --quick).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid

from absl import app, flags

from experiments import harness, trainer_workload

CONFIG = "configs/grpo_qwen0_5b_cpu.py"

_MODE = flags.DEFINE_list("mode", ["full", "lora"], "Variants of the recipe to run: full, lora.")
_ITERATIONS = flags.DEFINE_integer("iterations", 2, "RL iterations per run.")
_SAMPLE_S = flags.DEFINE_float("sample_s", 0.5, "Seconds between memory samples.")
_TIMEOUT_S = flags.DEFINE_float("timeout_s", 3600.0, "Longest a run may take.")

TAG_VAR = "STREAMRL_BENCH_TAG"
TIME_KEYS = ("iteration_s", "generation_s", "training_s", "weight_update_s")

_SHAPE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "tie_word_embeddings",
)


def _config_json(name: str) -> dict:
  """config.json keys of trainer_workload's model `name` (head_dim left for
  transformers to derive), less what transformers fills in itself."""
  from streamrl.models import hf  # pylint: disable=g-import-not-at-top

  config = hf.hf_config_dict(trainer_workload.model_config(name))
  return {
      k: config[k] for k in _SHAPE_KEYS + ("max_position_embeddings", "rope_theta", "rms_norm_eps")
  }


# The --quick run: Qwen2.5-0.5B's family and vocabulary, a sliver of its depth and width.
SMOKE_SHAPE = dict(
    vocab_size=32000,
    hidden_size=128,  # head_dim 32: the smallest vLLM's CPU attention takes
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
SMOKE_OVERRIDES = {
    "sampling.max_tokens": 16,
    "engine.max_model_len": 192,
    "trainer.micro_batch_size": 8,
}


def write_checkpoint(directory: str, shape: dict) -> str:
  """A random bf16 Qwen2 checkpoint of `shape` (config.json keys) and a
  SentencePiece tokenizer with a chat template, in `directory`."""
  import torch
  import transformers

  from streamrl.data import tokenizer

  if _written_shape(directory) != {k: shape[k] for k in _SHAPE_KEYS}:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**shape, torch_dtype="bfloat16")
    model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    del model
  tokenizer.save_sentencepiece_tokenizer(directory)
  return directory


def _written_shape(directory: str) -> dict | None:
  """The shape of the checkpoint already in `directory` (None if there is none)."""
  import transformers

  if not os.path.isfile(os.path.join(directory, "model.safetensors")):
    return None
  config = transformers.Qwen2Config.from_pretrained(directory)
  return {k: getattr(config, k, None) for k in _SHAPE_KEYS}


def write_gsm8k(path: str, rows: int = 32) -> str:
  """GSM8K-format JSONL: a question and a worked answer ending in `#### n`."""
  with open(path, "w") as f:
    for i in range(rows):
      pens, days = i + 3, (i % 5) + 2
      question = (
          f"A shop sells {pens} pens a day. How many pens does it sell in {days} days if it "
          "is closed on none of them?"
      )
      answer = f"It sells {pens} * {days} = <<{pens}*{days}={pens * days}>>{pens * days} pens.\n"
      f.write(json.dumps({"question": question, "answer": answer + f"#### {pens * days}"}) + "\n")
  return path


class TreeMemory:
  """Samples the summed RSS of every process carrying `tag` in its environment.

  A process is looked at once (by pid and start time); Ray's workers inherit
  the tag from the raylet, which inherits it from the run."""

  def __init__(self, tag: str, every_s: float):
    self.tag, self.every_s = tag, every_s
    self.peak, self.peak_by_kind, self.samples = 0, {}, 0
    # Resident memory counts a page shared by several processes (libraries,
    # a weights file both sides map) once per process. The proportional set
    # size splits it among them; with the run's /dev/shm growth (files no
    # process maps are in nobody's RSS) it is the run's memory counted once.
    # The machine's used memory (MemTotal - MemAvailable) over its value at
    # the start is a third view, which also sees what other jobs do.
    self.peak_pss_shm, self.peak_used = 0, 0
    self._shm0, self._used0 = _shm_used(), _machine_used()
    # Every sample: seconds since the start, the summed view above, RSS by process kind.
    self.timeline: list[dict] = []
    self._t0 = time.perf_counter()
    self._seen: dict[tuple[int, float], bool] = {}
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._loop, daemon=True)

  def __enter__(self) -> "TreeMemory":
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._stop.set()
    self._thread.join()

  def _tagged(self, p) -> bool:
    import psutil

    try:
      key = (p.pid, p.create_time())
    except psutil.Error:
      return False
    if key not in self._seen:
      try:
        self._seen[key] = p.environ().get(TAG_VAR) == self.tag
      except psutil.Error:
        self._seen[key] = False
    return self._seen[key]

  def _loop(self) -> None:
    import psutil

    while not self._stop.is_set():
      total, pss, by_kind = 0, 0, {}
      shm = max(0, _shm_used() - self._shm0)
      for p in psutil.process_iter():
        if not self._tagged(p):
          continue
        try:
          rss = p.memory_info().rss
          kind = _kind(p.cmdline())
          pss += _pss_private_and_files(p.pid)
        except (psutil.Error, OSError):
          continue
        total += rss
        by_kind[kind] = by_kind.get(kind, 0) + rss
      self.samples += 1
      self.timeline.append(
          {"t": round(time.perf_counter() - self._t0, 2), "pss_shm": pss + shm, **by_kind}
      )
      self.peak = max(self.peak, total)
      self.peak_pss_shm = max(self.peak_pss_shm, pss + shm)
      self.peak_used = max(self.peak_used, _machine_used() - self._used0)
      for kind, rss in by_kind.items():
        self.peak_by_kind[kind] = max(self.peak_by_kind.get(kind, 0), rss)
      self._stop.wait(self.every_s)


def _pss_private_and_files(pid: int) -> int:
  """The process's proportional share of its anonymous and file-backed pages
  (shared memory left out: the /dev/shm growth counts it once)."""
  total = 0
  with open(f"/proc/{pid}/smaps_rollup") as f:
    for line in f:
      if line.startswith(("Pss_Anon:", "Pss_File:")):
        total += int(line.split()[1]) * 1024
  return total


def _shm_used() -> int:
  st = os.statvfs("/dev/shm")
  return (st.f_blocks - st.f_bfree) * st.f_frsize


def _machine_used() -> int:
  with open("/proc/meminfo") as f:
    kb = {line.split(":")[0]: int(line.split()[1]) for line in f}
  return (kb["MemTotal"] - kb["MemAvailable"]) * 1024


def _kind(cmdline: list[str]) -> str:
  """A short name for a process of the run: its Ray actor class, Ray's daemon, or the launcher."""
  line = " ".join(cmdline)
  if line.startswith("ray::"):
    return line.split()[0][len("ray::") :].split(".")[0] or "ray_worker"
  for daemon in ("raylet", "gcs_server", "dashboard", "log_monitor", "runtime_env", "ray start"):
    if daemon in line:
      return "ray_daemons"
  if "launch/main.py" in line:
    return "launcher"
  return "other"


def run_mode(mode: str, model_dir: str, data: str, out: str) -> dict:
  """Runs the recipe's `mode` for --iterations; its measurements by name."""
  workdir = os.path.join(out, f"run_{mode}")
  if os.path.exists(workdir):
    import shutil

    shutil.rmtree(workdir)
  overrides = {
      "model.path": model_dir,
      "task.train_path": data,
      "trainer.num_iterations": _ITERATIONS.value,
      "log.progress": False,
      **(SMOKE_OVERRIDES if harness.QUICK.value else {}),
  }
  # --override (e.g. trainer.micro_batch_size=1) comes last and wins.
  cmd = harness.main_command(workdir, overrides, config=f"{CONFIG}:{mode}")
  tag = uuid.uuid4().hex
  env = dict(os.environ, **{TAG_VAR: tag})
  log_path = os.path.join(out, f"run_{mode}.log")
  print(" ".join(cmd), flush=True)
  t0 = time.perf_counter()
  with open(log_path, "w") as log, TreeMemory(tag, _SAMPLE_S.value) as memory:
    proc = subprocess.run(
        cmd,
        cwd=harness.ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        timeout=_TIMEOUT_S.value,
    )
  wall = time.perf_counter() - t0
  with open(log_path) as f:
    console = f.read()
  if proc.returncode != 0:
    print(console[-4000:], file=sys.stderr)
    print(_plan_table(workdir, console), file=sys.stderr)
    raise SystemExit(
        f"{mode}: launch/main.py exited with {proc.returncode} after {wall:.0f} s at a peak of "
        f"{memory.peak / 1e9:.2f} GB ({_by_kind(memory)}); its log is {log_path}."
    )
  rows = _iterations(os.path.join(workdir, "metrics.jsonl"))
  with open(os.path.join(out, f"run_{mode}_memory.jsonl"), "w") as f:
    f.writelines(json.dumps(row) + "\n" for row in memory.timeline)
  result = {
      "peak_rss_gb": round(memory.peak / 1e9, 2),
      "peak_pss_shm_gb": round(memory.peak_pss_shm / 1e9, 2),
      "peak_machine_gb": round(memory.peak_used / 1e9, 2),
  }
  for key in TIME_KEYS:
    values = [r[f"time/{key}"] for r in rows if f"time/{key}" in r]
    result[key] = round(sum(values) / len(values), 2) if values else float("nan")
  check_export(os.path.join(workdir, "hf"))
  details = {
      "wall_s": round(wall, 1),
      "peak_gb_by_process": {k: round(v / 1e9, 2) for k, v in memory.peak_by_kind.items()},
      "memory_samples": memory.samples,
      "per_iteration": {k: [r.get(f"time/{k}") for r in rows] for k in TIME_KEYS},
      # The trainer's own memory/* (streamrl/trainer/memory_plan.py `measured`) per iteration.
      "trainer_memory": {
          k: [r.get(k) for r in rows]
          for k in sorted({k for r in rows for k in r})
          if "memory/" in k
      },
      "plan": _plan_table(workdir, console),
  }
  print(f"{mode}: {result} {details['peak_gb_by_process']} in {wall:.0f} s", flush=True)
  print(f"{mode}: trainer {details['trainer_memory']}", flush=True)
  return {"result": result, "details": details}


def _iterations(path: str) -> list[dict]:
  with open(path) as f:
    rows = [json.loads(line) for line in f]
  return [r for r in rows if r.get("step", 0) >= 1 and "time/iteration_s" in r]


def _by_kind(memory: TreeMemory) -> str:
  return ", ".join(f"{k} {v / 1e9:.2f}" for k, v in sorted(memory.peak_by_kind.items()))


def _plan_table(workdir: str, console: str) -> str:
  """The memory plan the trainer logged: from its log in the workdir, else the console."""
  text = console
  path = os.path.join(workdir, "trainer.log")
  if os.path.isfile(path):
    with open(path) as f:
      text = f.read()
  lines = text.splitlines()
  for i, line in enumerate(lines):
    if "Memory plan of" in line:
      end = next((j for j in range(i, len(lines)) if " total " in lines[j]), i)
      return "\n".join(lines[i : end + 1])
  return "(no memory plan in the logs)"


def check_export(hf_dir: str) -> None:
  """The exported policy loads in transformers and gives finite logits."""
  import torch
  import transformers

  model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.bfloat16)
  with torch.no_grad():
    logits = model(torch.tensor([[1, 2, 3]])).logits
  if not torch.isfinite(logits.float()).all():
    raise SystemExit(f"The export in {hf_dir} loads but gives non-finite logits.")
  del model


def main(argv):
  del argv
  bad = [m for m in _MODE.value if m not in ("full", "lora")]
  if bad:
    raise app.UsageError(f"--mode has {bad}; use full, lora or both.")
  root = harness.workdir("/tmp/bench_real_model")  # checkpoint, data and workdirs
  shape = _config_json("qwen2_0_5b")  # Qwen2.5-0.5B-Instruct's shapes
  if harness.QUICK.value:
    shape.update(SMOKE_SHAPE)
  name = "smoke" if harness.QUICK.value else "qwen2_5_0_5b"
  model_dir = write_checkpoint(os.path.join(root, f"model_{name}"), shape)
  data = write_gsm8k(os.path.join(root, "gsm8k.jsonl"))
  runs = {mode: run_mode(mode, model_dir, data, root) for mode in _MODE.value}
  line = {f"{m}_{k}": str(v) for m, r in runs.items() for k, v in r["result"].items()}
  summary = {
      "quick": harness.QUICK.value,
      "iterations": _ITERATIONS.value,
      "details": {m: r["details"] for m, r in runs.items()},
  }
  harness.report(summary=summary, **line)


if __name__ == "__main__":
  app.run(main)
