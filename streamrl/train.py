"""The RL run: set up policy, data, generator and trainer, then iterate.

One iteration (synchronous, on-policy): prompts -> generator (each sample as
it finishes) -> rewards -> trainer (old / ref logprobs, values, advantages,
PPO epochs) -> weights pushed to the generator. The pipeline modes of
`streamrl/pipeline` reorder these same parts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Sequence

import numpy as np

from streamrl import metrics as metrics_lib
from streamrl.data import loader as loader_lib
from streamrl.data import rewards as rewards_lib
from streamrl.data import tasks as tasks_lib
from streamrl.data import tokenizer as char_tok
from streamrl.models import config as model_config_lib
from streamrl.models import hf, tiny
from streamrl.models.transformer import Transformer
from streamrl.trainer import sft
from streamrl.trainer.checkpoint import Checkpointer
from streamrl.trainer.rl_trainer import RLTrainer

log = logging.getLogger(__name__)

PIPELINE_MODES = ("colocated", "sync", "stream", "async")


# ---------------------------------------------------------------- validation
def validate(config) -> None:
  """Config consistency checks, each failing with one sentence naming the fix."""
  algo, tr, gen = config.algo, config.trainer, config.generation
  if config.pipeline.mode not in PIPELINE_MODES:
    raise ValueError(f"pipeline.mode={config.pipeline.mode!r} is unknown; use one of {PIPELINE_MODES}.")
  n = tr.prompts_per_iteration * algo.group_size
  if n % tr.mini_batch_size:
    raise ValueError(
        f"prompts_per_iteration * group_size = {n} is not a multiple of "
        f"trainer.mini_batch_size={tr.mini_batch_size}; change one of them.")
  if config.pipeline.mode == "stream" and tr.mini_batch_size % algo.group_size:
    raise ValueError(
        f"pipeline.mode='stream' trains whole groups as they finish, so "
        f"trainer.mini_batch_size={tr.mini_batch_size} must be a multiple of "
        f"algo.group_size={algo.group_size}.")
  if tr.mini_batch_size % tr.micro_batch_size:
    raise ValueError(f"trainer.mini_batch_size={tr.mini_batch_size} is not a multiple of "
                     f"trainer.micro_batch_size={tr.micro_batch_size}.")
  if algo.advantage == "gae" and not algo.use_critic:
    raise ValueError("algo.advantage='gae' needs a critic; set algo.use_critic=True or "
                     "use 'grpo' / 'rloo' / 'reinforce_pp'.")
  if algo.advantage in ("grpo", "rloo") and algo.group_size < 2:
    raise ValueError(f"algo.advantage={algo.advantage!r} needs algo.group_size >= 2.")
  if gen.max_tokens >= gen.max_model_len:
    raise ValueError("generation.max_tokens must be below generation.max_model_len.")
  rewards_lib.get_reward_fn(config.task.reward)  # unknown name -> clear error


# ------------------------------------------------------------------- setup
def _fingerprint(obj) -> str:
  return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


def load_examples(config) -> tuple[list, list]:
  """Train and held-out eval examples of the configured task."""
  task = config.task
  if task.kind == "synthetic":
    kw = dict(ops=tuple(task.ops), max_answer_len=task.max_answer_len)
    train = tasks_lib.make_examples(config.warmstart.num_examples, config.seed, **kw)
    evals = tasks_lib.make_examples(task.num_eval, config.seed + 10_000, first_id=10**6, **kw)
    return train, evals
  if task.kind == "jsonl":
    from streamrl.data import jsonl  # pylint: disable=g-import-not-at-top
    examples = jsonl.load_jsonl(task.jsonl_path)
    n_eval = min(task.num_eval, len(examples) // 10)
    return examples[n_eval:], examples[:n_eval]
  raise ValueError(f"task.kind={task.kind!r} is unknown; use 'synthetic' or 'jsonl'.")


def prepare_model_dir(config, workdir: str, train_examples: Sequence) -> str:
  """The policy's HF directory: the configured path, or the warm-started tiny.

  The tiny warm start is cached in the workdir under a name derived from what
  it depends on, and reused on the next run.
  """
  if config.model.path:
    hf.read_config(config.model.path)  # clear error for a bad path / arch
    return config.model.path
  # Only what changes the warm-started weights (not, say, the eval set size).
  key = _fingerprint({"tiny": config.model.tiny, "warm": config.warmstart.to_dict(),
                      "ops": list(config.task.ops), "max_answer_len": config.task.max_answer_len,
                      "seed": config.seed})
  path = os.path.join(workdir, f"warmstart-{key}")
  if os.path.isfile(os.path.join(path, "model.safetensors")):
    log.info("Reusing warm-started policy %s", path)
    return path
  makers = {"qwen2": model_config_lib.tiny_qwen2, "llama": model_config_lib.tiny_llama}
  if config.model.tiny not in makers:
    raise ValueError(f"model.tiny={config.model.tiny!r} is unknown; use one of {sorted(makers)}.")
  cfg = makers[config.model.tiny](char_tok.VOCAB_SIZE)
  from flax import nnx  # pylint: disable=g-import-not-at-top
  model = Transformer(cfg, rngs=nnx.Rngs(config.seed))
  ws = config.warmstart
  if ws.steps:
    pairs = [([char_tok.BOS_ID] + char_tok.encode(e.prompt),
              char_tok.encode(e.answer) + [char_tok.EOS_ID]) for e in train_examples]
    seq_len = max(len(p) + len(a) for p, a in pairs)
    t0 = time.time()
    model, loss = sft.warm_start(model, pairs, steps=ws.steps, batch_size=ws.batch_size,
                                 lr=ws.lr, seq_len=seq_len + 1, seed=config.seed,
                                 log_every=max(ws.steps // 5, 1))
    log.info("Warm-up: %d steps, final loss %.3f, %.0f s", ws.steps, loss, time.time() - t0)
  tmp = f"{path}.tmp{os.getpid()}"
  tiny.build_tiny_model_dir(tmp, cfg, model=model)
  try:
    os.replace(tmp, path)  # Atomic: a reader never sees half a directory.
  except OSError:
    # Another run finished the same warm start first; theirs is identical.
    shutil.rmtree(tmp, ignore_errors=True)
  return path


class Tokenizer:
  """Prompt encoding / response decoding from the model dir's tokenizer.json."""

  def __init__(self, model_dir: str):
    import tokenizers  # pylint: disable=g-import-not-at-top
    self._tok = tokenizers.Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))

  def encode_prompt(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=True).ids

  def decode(self, ids: Sequence[int]) -> str:
    return self._tok.decode(list(ids), skip_special_tokens=True)


@dataclasses.dataclass
class Rewarder:
  """Scores samples with the task's verifier; a raising verifier scores 0."""
  reward_fn: object
  tokenizer: Tokenizer
  errors: int = 0

  def __call__(self, samples, examples_by_id) -> tuple[np.ndarray, np.ndarray]:
    scores, correct = [], []
    for s in samples:
      ex = examples_by_id[s.prompt_id]
      text = self.tokenizer.decode(s.token_ids)
      r, failed = rewards_lib.safe_reward(self.reward_fn, text, ex)
      self.errors += int(failed)
      scores.append(r)
      correct.append(float(text.strip() == ex.answer.strip()))
    return np.asarray(scores, np.float32), np.asarray(correct, np.float32)


def make_requests(examples: Sequence, tokenizer: Tokenizer, group_size: int):
  """One generator request per sample: id = position * group_size + k."""
  requests, by_id = [], {}
  for j, ex in enumerate(examples):
    ids = tokenizer.encode_prompt(ex.prompt)
    for k in range(group_size):
      requests.append((j * group_size + k, ids))
      by_id[j * group_size + k] = ex
  return requests, by_id


def evaluate(generator, examples, tokenizer, config, seed: int) -> dict:
  """Held-out exact-match accuracy: sampled (the policy's pass@1) and greedy."""
  from streamrl.generator.vllm_engine import SamplingConfig  # pylint: disable=g-import-not-at-top
  requests, by_id = make_requests(examples, tokenizer, 1)
  out = {}
  for name, temp in (("accuracy", config.generation.temperature), ("accuracy_greedy", 0.0)):
    sampling = SamplingConfig(temperature=temp, max_tokens=config.generation.max_tokens, seed=seed)
    hits = [float(tokenizer.decode(s.token_ids).strip() == by_id[s.prompt_id].answer.strip())
            for s in generator.generate(requests, sampling)]
    out[name] = float(np.mean(hits))
  return out


def length_metrics(samples) -> dict:
  lengths = np.array([len(s.token_ids) for s in samples], np.float64)
  return {"response_length/mean": lengths.mean(),
          "response_length/p50": np.percentile(lengths, 50),
          "response_length/p90": np.percentile(lengths, 90),
          "response_length/max": lengths.max()}


# --------------------------------------------------------------------- run
def fingerprint(config) -> dict:
  """What must match for a workdir's checkpoints to be resumed."""
  return {"model": {"path": config.model.path, "tiny": config.model.tiny},
          "warmstart": config.warmstart.to_dict(), "task": config.task.to_dict(),
          "algo": config.algo.to_dict(), "mesh": config.mesh.to_dict(),
          "prompts_per_iteration": config.trainer.prompts_per_iteration,
          "seed": config.seed}


def write_placement(workdir: str, placement: dict | None, pipeline) -> None:
  """Where the trainer and each generator instance run: <workdir>/placement.json."""
  placement = dict(placement or {"trainer": {"pid": os.getpid(),
                                             "cores": sorted(os.sched_getaffinity(0))}})
  placement["generators"] = {
      str(i): {k: v for k, v in info.items() if k in ("pid", "cores", "torch_threads")}
      for i, info in getattr(pipeline.backend, "placement", {}).items()}
  if not placement["generators"]:
    placement["generators"] = {"0": {"in_trainer_process": True}}
  with open(os.path.join(workdir, "placement.json"), "w") as f:
    json.dump(placement, f, indent=1, default=str)


def run(config, workdir: str) -> dict:
  """Runs (or resumes) the RL experiment in `workdir`; returns final metrics.

  The disaggregated modes run the trainer as a Ray actor on the training
  pool (streamrl/pipeline/trainer_actor.py) unless cluster.trainer_actor is
  False; colocated runs here.
  """
  validate(config)
  if config.pipeline.mode != "colocated" and config.cluster.get("trainer_actor", True):
    # Refuse an incompatible workdir here too, before Ray or an actor starts.
    Checkpointer(os.path.join(workdir, "checkpoints"), keep=config.checkpoint.keep,
                 fingerprint=fingerprint(config)).close()
    from streamrl.pipeline import trainer_actor  # pylint: disable=g-import-not-at-top
    return trainer_actor.run(config, workdir)
  return run_here(config, workdir)


def run_here(config, workdir: str, cluster=None, placement: dict | None = None) -> dict:
  """The run itself, with the trainer in this process.

  `cluster` (a ClusterInfo) is the Ray cluster the generators go to, when the
  caller already joined it; `placement` describes this process, for
  <workdir>/placement.json.
  """
  validate(config)
  os.makedirs(workdir, exist_ok=True)
  # Refuse an incompatible workdir before anything is written into it.
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=config.checkpoint.keep,
                      fingerprint=fingerprint(config))
  train_examples, eval_examples = load_examples(config)
  model_dir = prepare_model_dir(config, workdir, train_examples)
  _, policy = hf.load_hf(model_dir)
  tokenizer = Tokenizer(model_dir)
  rewarder = Rewarder(rewards_lib.get_reward_fn(config.task.reward), tokenizer)
  trainer = RLTrainer(config, policy)
  loader = loader_lib.PromptLoader(train_examples, config.trainer.prompts_per_iteration,
                                   seed=config.seed)
  start, meta = 0, {}
  if ckpt.latest_step() is not None:
    start, arrays, meta = ckpt.restore(trainer.checkpoint_arrays())
    trainer.load_checkpoint_arrays(arrays)
    loader.set_state(meta["loader"])
    rewarder.errors = meta.get("reward_errors", 0)
    log.info("Resumed from iteration %d", start)

  from streamrl.pipeline import make_pipeline  # pylint: disable=g-import-not-at-top
  pipeline = make_pipeline(config, model_dir, trainer, workdir=workdir, cluster=cluster)
  write_placement(workdir, placement, pipeline)
  if start:
    pipeline.push_weights(trainer.hf_tensors(), version=start)

  writer = metrics_lib.MetricsWriter(workdir, purge_step=start + 1 if start else None)
  metrics_lib.save_config(config, workdir)
  progress = metrics_lib.Progress(config.trainer.num_iterations, "RL", initial=start)
  final: dict = {}
  try:
    if start == 0:
      initial = evaluate(pipeline.generator, eval_examples, tokenizer, config, config.seed)
      writer.scalars(0, {f"eval/{k}": v for k, v in initial.items()})
      final.update({f"initial_eval/{k}": v for k, v in initial.items()})
      log.info("Warm-start eval: %s", initial)
    for it in range(start, config.trainer.num_iterations):
      stats = pipeline.iteration(it, loader, tokenizer, rewarder)
      scalars = stats["scalars"]
      scalars["reward/errors_total"] = rewarder.errors
      if config.log.eval_every and (it + 1) % config.log.eval_every == 0 or \
          it + 1 == config.trainer.num_iterations:
        ev = evaluate(pipeline.generator, eval_examples, tokenizer, config, config.seed)
        scalars.update({f"eval/{k}": v for k, v in ev.items()})
        final.update({f"eval/{k}": v for k, v in ev.items()})
      writer.scalars(it + 1, scalars)
      writer.histogram(it + 1, "response_length", stats["lengths"])
      writer.histogram(it + 1, "staleness", [it - s.weight_version for s in stats["samples"]])
      progress.update(1, reward=f"{scalars['reward/mean']:.3f}",
                      acc=f"{scalars['accuracy']:.3f}")
      if (it + 1) % config.checkpoint.every == 0 or it + 1 == config.trainer.num_iterations:
        ckpt.save(it + 1, trainer.checkpoint_arrays(),
                  {"loader": stats["loader_state"], "reward_errors": rewarder.errors,
                   "weight_version": it + 1})
      final.update({k: v for k, v in scalars.items() if not k.startswith("eval/")})
  finally:
    progress.close()
    writer.close()
    pipeline.close()
  with open(os.path.join(workdir, "final_metrics.json"), "w") as f:
    json.dump(final, f, indent=2, sort_keys=True)
  return final
