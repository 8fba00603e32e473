"""Generate the whole batch, then train on it, then push weights (on-policy)."""

from __future__ import annotations

import time

import numpy as np

from streamrl.generator.vllm_engine import GeneratorInstance, SamplingConfig


def make_generator(config, model_dir: str, instance_id: int = 0) -> GeneratorInstance:
  g = config.generation
  return GeneratorInstance(model_dir, instance_id=instance_id, max_num_seqs=g.max_num_seqs,
                           max_model_len=g.max_model_len, seed=config.seed,
                           kv_cache_gib=g.kv_cache_gib, dtype=config.model.dtype)


def sampling_for(config, iteration: int) -> SamplingConfig:
  g = config.generation
  # A fresh seed per iteration; each request adds its id to it.
  return SamplingConfig(temperature=g.temperature, top_p=g.top_p, max_tokens=g.max_tokens,
                        seed=config.seed * 1_000_003 + iteration * 100_003)


def iteration_scalars(samples, scores, correct, prep_metrics, train_metrics, times) -> dict:
  lengths = np.array([len(s.token_ids) for s in samples], np.float64)
  tokens = float(lengths.sum())
  total = sum(times.values())
  out = {"reward/mean": float(np.mean(scores)), "accuracy": float(np.mean(correct)),
         "response_length/mean": lengths.mean(),
         "response_length/p50": float(np.percentile(lengths, 50)),
         "response_length/p90": float(np.percentile(lengths, 90)),
         "response_length/max": lengths.max(),
         "throughput/samples_per_s": len(samples) / total,
         "throughput/tokens_per_s": tokens / total}
  out.update({f"time/{k}": v for k, v in times.items()})
  out.update({f"train/{k}": v for k, v in prep_metrics.items()})
  out.update({f"train/{k}": v for k, v in train_metrics.items()})
  return out


class SyncPipeline:
  """One generator instance in this process; generation and training alternate."""

  def __init__(self, config, model_dir: str, trainer):
    from streamrl.train import make_requests  # pylint: disable=g-import-not-at-top
    self._make_requests = make_requests
    self.config = config
    self.trainer = trainer
    self.generator = make_generator(config, model_dir)

  def push_weights(self, tensors, version: int | None = None) -> None:
    self.generator.update_weights(tensors, version)

  def iteration(self, it: int, examples, tokenizer, rewarder) -> dict:
    cfg = self.config
    requests, by_id = self._make_requests(examples, tokenizer, cfg.algo.group_size)
    t0 = time.perf_counter()
    samples = sorted(self.generator.generate(requests, sampling_for(cfg, it)),
                     key=lambda s: s.prompt_id)
    t1 = time.perf_counter()
    scores, correct = rewarder(samples, by_id)
    minis, prep = self.trainer.prepare(samples, scores)
    train_metrics = self.trainer.train(minis, np.random.default_rng([cfg.seed, it]))
    t2 = time.perf_counter()
    self.push_weights(self.trainer.hf_tensors())
    t3 = time.perf_counter()
    times = {"generation_s": t1 - t0, "training_s": t2 - t1, "weight_update_s": t3 - t2}
    return {"scalars": iteration_scalars(samples, scores, correct, prep, train_metrics, times),
            "lengths": [len(s.token_ids) for s in samples], "samples": samples}

  def close(self) -> None:
    pass
