"""The vLLM generator against the Flax model: the trainer's importance ratios
are only right if these logprobs agree."""

import json
import logging
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from streamrl.data import tokenizer as tok
from streamrl.generator import vllm_engine, vllm_worker
from streamrl.generator.config import Sampling
from streamrl.generator.vllm_engine import GeneratorInstance, check_model_dir
from streamrl.models import config, hf, tiny, transformer

pytestmark = [pytest.mark.engine]

PROMPTS = [(i, [1] + [4 + (3 * i + j) % 40 for j in range(2 + 2 * i)]) for i in range(8)]


def flax_logprobs(model, sample, temperature, compute=config.ComputeConfig()):
  tokens = jnp.asarray([list(sample.prompt_token_ids) + list(sample.token_ids)])
  logp, _ = transformer.sequence_logprobs(model, tokens, temperature=temperature, compute=compute)
  n = len(sample.prompt_token_ids)
  return np.asarray(logp[0, n - 1 : -1])


def max_logprob_error(generator, model, temperature=0.8, seed=0):
  samples = list(
      generator.generate(PROMPTS, Sampling(temperature=temperature, max_tokens=24), seed=seed)
  )
  assert sorted(s.prompt_id for s in samples) == [p for p, _ in PROMPTS]
  errs = [
      np.abs(flax_logprobs(model, s, temperature) - np.array(s.logprobs)).max() for s in samples
  ]
  return max(errs), samples


TINY = {
    "qwen2": config.tiny_qwen2,
    "llama": config.tiny_llama,
    "qwen3": config.tiny_qwen3,
    "llama3": config.tiny_llama3,  # Llama 3.1 RoPE scaling
    "mistral": config.tiny_mistral,
}


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def engine(request, tmp_path_factory):
  cfg = TINY[request.param](64)
  path = tiny.build_tiny_model_dir(str(tmp_path_factory.mktemp(request.param)), cfg, seed=7)
  gen = GeneratorInstance(path, max_num_seqs=8, max_model_len=128, seed=0)
  _, model = hf.load_hf(path)
  return gen, model, cfg


# The other architectures only here: each engine costs a start-up (~4 s).
@pytest.mark.parametrize("engine", list(TINY), indirect=True)
def test_sampled_logprobs_match_flax(engine):
  gen, model, _ = engine
  err, samples = max_logprob_error(gen, model)
  assert err < 1e-3
  for s in samples:
    assert len(s.token_ids) == len(s.logprobs) > 0
    assert s.finish_reason in ("stop", "length")
    assert s.weight_version == gen.weight_version


def _bf16_model_dir(path, cfg, model):
  hf.save_hf(
      model,
      path,
      dtype="bfloat16",
      bos_token_id=tok.BOS_ID,
      eos_token_id=tok.EOS_ID,
      pad_token_id=tok.PAD_ID,
  )
  tok.save_hf_tokenizer(path, model_max_length=cfg.max_position_embeddings)
  return path


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_bf16_engine_logprobs_match_the_bf16_trainer(family, tmp_path):
  """A bfloat16 vLLM engine against the trainer's bf16 compute (fp32 master
  weights cast in the forward, fp32 LM head and log-softmax) on the sampled
  tokens. Both read the same bf16 weights: the checkpoint is the fp32 model
  rounded to bf16, as `export_weights` hands it over.

  Measured on this CPU (8 prompts x 24 tokens, temperature 0.8), max / mean
  |trainer - vLLM|:
    random init (logprobs ~ -4.1): qwen2 7.5e-3 / 1.5e-3, llama 6.8e-3 / 1.9e-3
      (fp32 trainer compute: 8.1e-3 / 1.7e-3 and 5.7e-3 / 1.9e-3);
    final norm x10 (logits spread ~2, as a trained model's):
      qwen2 8.1e-2 / 1.2e-3, llama 8.3e-2 / 1.4e-2 -- no better with fp32
      trainer compute (8.4e-2, 5.8e-2 max): vLLM's bf16 logits dominate.
  Tolerances: max 2e-2, mean 4e-3 (random init); max 0.2, mean 3e-2 (x10).
  """
  cfg = {"qwen2": config.tiny_qwen2, "llama": config.tiny_llama}[family](64)
  model = transformer.Transformer(cfg, rngs=nnx.Rngs(7))
  path = _bf16_model_dir(str(tmp_path / family), cfg, model)
  gen = GeneratorInstance(path, max_num_seqs=8, max_model_len=128, seed=0, dtype="bfloat16")
  bf16 = config.ComputeConfig(dtype="bfloat16")

  def errors(m):
    samples = list(gen.generate(PROMPTS, Sampling(temperature=0.8, max_tokens=24), seed=0))
    return np.concatenate(
        [np.abs(flax_logprobs(m, s, 0.8, bf16) - np.array(s.logprobs)) for s in samples]
    )

  try:
    err = errors(model)
    assert err.max() < 2e-2 and err.mean() < 4e-3, (err.max(), err.mean())
    sharp = transformer.Transformer(cfg, rngs=nnx.Rngs(7))
    scale = sharp.trunk.final_norm.scale
    scale[...] = 10.0 * scale[...]
    gen.update_weights(hf.to_hf_tensors(sharp, "bfloat16"))
    err = errors(sharp)
    assert err.max() < 0.2 and err.mean() < 3e-2, (err.max(), err.mean())
  finally:
    gen.close()


def test_weight_update_takes_effect_and_drops_prefix_cache(engine):
  gen, old_model, cfg = engine
  # Warm the prefix cache with the old weights on exactly these prompts.
  list(gen.generate(PROMPTS, Sampling(max_tokens=4), seed=1))
  before = gen.weight_version
  new_model = transformer.Transformer(cfg, rngs=nnx.Rngs(123))
  assert gen.update_weights(hf.to_hf_tensors(new_model)) == before + 1
  err_new, samples = max_logprob_error(gen, new_model, seed=1)
  # Reused prompt KV from the old weights would break this agreement.
  assert err_new < 1e-3
  assert all(s.weight_version == before + 1 for s in samples)
  err_old = max(
      np.abs(flax_logprobs(old_model, s, 0.8) - np.array(s.logprobs)).max() for s in samples
  )
  assert err_old > 0.1
  with pytest.raises(ValueError, match="must increase"):
    gen.update_weights(hf.to_hf_tensors(new_model), version=before)


def test_a_stopped_response_resumes_under_new_weights_with_each_versions_logprobs(engine):
  """Partial rollouts: stop mid-response, load new weights, resume from
  prompt + tokens so far with the budget left; each segment's logprobs are
  those of the weights that sampled it (fp32, <= 1e-3)."""
  gen, _, cfg = engine
  old = transformer.Transformer(cfg, rngs=nnx.Rngs(41))
  new = transformer.Transformer(cfg, rngs=nnx.Rngs(42))
  v_old = gen.update_weights(hf.to_hf_tensors(old))
  sampling, seed = Sampling(temperature=0.8, max_tokens=24), 5
  steps = []
  # Stop after 6 engine steps; EOS ignored, so no response is done by then.
  first = list(
      gen.generate(
          PROMPTS,
          sampling,
          seed=seed,
          ignore_eos=True,
          stop=lambda: steps.append(1) or len(steps) > 6,
      )
  )
  assert sorted(s.prompt_id for s in first) == [p for p, _ in PROMPTS]
  assert all(s.finish_reason == vllm_engine.PARTIAL for s in first)
  assert all(0 < len(s.token_ids) < 24 and s.weight_version == v_old for s in first)
  assert gen.in_flight == 0
  first_file = gen.last_weights_file
  v_new = gen.update_weights(hf.to_hf_tensors(new))
  assert gen.last_weights_file == first_file  # the same file, rewritten in place
  resume = [(s.prompt_id, s.prompt_token_ids + s.token_ids, 24 - len(s.token_ids)) for s in first]
  rest = {s.prompt_id: s for s in gen.generate(resume, sampling, seed=seed, ignore_eos=True)}
  for a in first:
    b = rest[a.prompt_id]
    assert b.weight_version == v_new and b.finish_reason == "length"
    assert len(a.token_ids) + len(b.token_ids) == 24
    np.testing.assert_allclose(flax_logprobs(old, a, 0.8), a.logprobs, atol=1e-3)
    np.testing.assert_allclose(flax_logprobs(new, b, 0.8), b.logprobs, atol=1e-3)
    # The old weights would not have given the resumed tokens these logprobs.
    assert np.abs(flax_logprobs(old, b, 0.8) - np.array(b.logprobs)).max() > 0.1


@pytest.mark.parametrize("dtype, keep", [("float32", True), ("bfloat16", False)])
def test_lazy_update_equals_an_engine_started_from_those_weights(dtype, keep, tmp_path):
  """The trainer's path: a lazy export in the engine's dtype, streamed tensor by tensor into one
  file the engine loads in place. Afterwards the engine samples exactly what an engine started
  from a checkpoint of the same weights samples. (Its own engines, closed at the end: a closed
  in-process engine takes vLLM's process-wide state with it, so this runs apart from `engine`.)"""
  cfg = config.tiny_qwen2(64)
  new_model = transformer.Transformer(cfg, rngs=nnx.Rngs(77))
  sampling, seed = Sampling(temperature=1.0, max_tokens=12), 5
  kwargs = dict(max_num_seqs=8, max_model_len=128, seed=0, dtype=dtype)
  old_dir = tiny.build_tiny_model_dir(str(tmp_path / "old"), cfg, seed=7)
  gen = GeneratorInstance(old_dir, keep_weights_file=keep, **kwargs)
  try:
    gen.update_weights(hf.HFTensors(new_model, dtype))
    # Kept for the next update (rewritten in place), or removed once loaded.
    assert os.path.exists(gen.last_weights_file) == keep
    updated = {s.prompt_id: s for s in gen.generate(PROMPTS, sampling, seed=seed)}
  finally:
    gen.close()
  assert not os.path.exists(gen.last_weights_file)  # never outlives the engine
  new_dir = hf.save_hf(
      new_model,
      str(tmp_path / "new"),
      dtype=dtype,
      bos_token_id=tok.BOS_ID,
      eos_token_id=tok.EOS_ID,
      pad_token_id=tok.PAD_ID,
  )
  tok.save_hf_tokenizer(new_dir, model_max_length=cfg.max_position_embeddings)
  fresh = GeneratorInstance(new_dir, **kwargs)
  try:
    started = {s.prompt_id: s for s in fresh.generate(PROMPTS, sampling, seed=seed)}
  finally:
    fresh.close()
  assert sorted(updated) == sorted(started) == [p for p, _ in PROMPTS]
  for p in updated:
    assert updated[p].token_ids == started[p].token_ids
    np.testing.assert_array_equal(updated[p].logprobs, started[p].logprobs)


def test_never_runs_more_than_the_cap(engine, monkeypatch):
  gen, _, _ = engine
  seen = []
  real_add = gen._engine.add_request

  def add(*args, **kwargs):
    seen.append(gen._engine.get_num_unfinished_requests() + 1)
    return real_add(*args, **kwargs)

  monkeypatch.setattr(gen._engine, "add_request", add)
  samples = list(gen.generate(PROMPTS, Sampling(max_tokens=12), seed=0, max_in_flight=3))
  assert sorted(s.prompt_id for s in samples) == [p for p, _ in PROMPTS]
  assert len(seen) == len(PROMPTS) and max(seen) == 3


def test_stream_yields_before_batch_end(engine):
  gen, _, _ = engine
  # Two prompts with max_tokens 3 and one that runs 40: the first yields
  # while the long one is still running.
  long_cfg = Sampling(temperature=1.0, max_tokens=40)
  it = gen.generate([(0, [1, 5, 6]), (1, [1, 7, 8])], long_cfg, seed=3, max_in_flight=2)
  first = next(it)
  # Closing early aborts the rest and leaves the engine idle.
  it.close()
  assert gen.in_flight == 0 and not gen._engine.has_unfinished_requests()
  assert first.prompt_id in (0, 1)


def test_weight_update_is_quiet(engine):
  """vLLM's expected reload messages (modules with no checkpoint tensors, progress
  lines, the prefix-cache reset) do not reach vLLM's console handler."""
  gen, _, cfg = engine
  records = []
  capture = logging.Handler(logging.DEBUG)
  capture.emit = records.append
  vllm_logger = logging.getLogger("vllm")  # vLLM's handler sits here (no propagation above).
  vllm_logger.addHandler(capture)
  try:
    gen.update_weights(hf.to_hf_tensors(transformer.Transformer(cfg, rngs=nnx.Rngs(5))))
  finally:
    vllm_logger.removeHandler(capture)
  noisy = [
      r.getMessage()
      for r in records
      if any(
          m in r.getMessage() for m in ("Failed to load weights", "Reloading", "reset prefix cache")
      )
  ]
  assert not noisy
  # Nothing stays armed: the next reset (e.g. one we did not cause) is shown again.
  assert not vllm_worker.PREFIX_RESET_FILTER.armed


def test_reload_filter_hides_only_the_expected_layers():
  quiet = vllm_worker.ReloadLogFilter(frozenset({"RotaryEmbedding"}))

  def record(msg, *args):
    return logging.LogRecord("vllm.x", logging.WARNING, __file__, 1, msg, args, None)

  assert not quiet.filter(record(vllm_worker.NOT_LOADED_MSG, "RotaryEmbedding"))
  # A layer that should have received weights but did not is a real defect.
  assert quiet.filter(record(vllm_worker.NOT_LOADED_MSG, "QKVParallelLinear"))
  assert not quiet.filter(record("Reloading and processing weights took %.2f seconds", 0.1))
  assert quiet.filter(record("Following weights were not loaded from checkpoint: %s", {"x"}))
  assert quiet.hidden == {"RotaryEmbedding"}


def test_layers_without_checkpoint_weights():
  import torch  # pylint: disable=g-import-not-at-top

  class Rotary(torch.nn.Module):

    def __init__(self):
      super().__init__()
      self.register_buffer("cos_sin_cache", torch.zeros(4), persistent=False)

  class Head(torch.nn.Module):

    def __init__(self, weight):
      super().__init__()
      self.weight = weight

  class Model(torch.nn.Module):

    def __init__(self, tied):
      super().__init__()
      self.config = type("Config", (), {"tie_word_embeddings": tied})()
      self.embed = torch.nn.Embedding(8, 4)
      self.rotary = Rotary()
      self.norm = torch.nn.LayerNorm(4)
      self.lm_head = Head(self.embed.weight if tied else torch.nn.Parameter(torch.zeros(8, 4)))

  assert vllm_worker.layers_without_checkpoint_weights(Model(tied=True)) == {"Rotary", "Head"}
  assert vllm_worker.layers_without_checkpoint_weights(Model(tied=False)) == {"Rotary"}


def test_public_views_step_callback_and_ignore_eos(engine):
  from vllm.platforms import current_platform  # pylint: disable=g-import-not-at-top

  gen, _, _ = engine
  assert gen.eos_token_ids == (tok.EOS_ID,)
  limits = gen.scheduler_limits()
  assert limits.max_num_seqs == 8
  assert limits.chunked_prefill == (not current_platform.is_cpu())
  assert limits.max_num_batched_tokens >= gen.max_model_len
  seen = []
  gen.set_step_callback(seen.append)
  try:
    samples = list(
        gen.generate(PROMPTS, Sampling(max_tokens=12), seed=0, max_in_flight=3, ignore_eos=True)
    )
  finally:
    gen.set_step_callback(None)
  # One call per engine step, with the requests in flight for it.
  assert seen and max(seen) == 3 and min(seen) >= 1
  assert gen.in_flight == 0
  # Every sample decodes exactly max_tokens tokens, EOS or not.
  assert sorted(s.prompt_id for s in samples) == [p for p, _ in PROMPTS]
  assert all(len(s.token_ids) == 12 for s in samples)
  calls = len(seen)
  list(gen.generate(PROMPTS[:2], Sampling(max_tokens=4), seed=0))
  assert len(seen) == calls  # A removed callback is not called.


def test_bad_model_dirs_are_refused_before_engine_start(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    check_model_dir(str(tmp_path / "missing"), on_cpu=True)
  import dataclasses

  bad = dataclasses.replace(config.tiny_qwen2(64), hidden_size=192, num_heads=4, head_dim=48)
  d = tiny.build_tiny_model_dir(str(tmp_path / "hd48"), bad)
  with pytest.raises(ValueError, match="head_dim=48"):
    check_model_dir(d, on_cpu=True)
  d = tiny.build_tiny_model_dir(str(tmp_path / "vocab"), config.tiny_qwen2(32))
  with pytest.raises(ValueError, match="vocab_size=32"):
    check_model_dir(d, on_cpu=True)
  d = tiny.build_tiny_model_dir(str(tmp_path / "arch"))
  data = json.loads((tmp_path / "arch" / "config.json").read_text())
  data["architectures"] = ["GPT2LMHeadModel"]
  (tmp_path / "arch" / "config.json").write_text(json.dumps(data))
  with pytest.raises(ValueError, match="Unsupported architecture"):
    GeneratorInstance(d)


def test_many_long_seeded_prompts_do_not_kill_the_cpu_engine(tmp_path):
  """More prompt tokens than one engine step takes, with per-request seeds:
  a partially prefilled request would make vLLM rewind a CPU generator's
  offset and kill the engine (seen in a GRPO run); StreamRL turns chunked
  prefill off on CPU."""
  path = tiny.build_tiny_model_dir(str(tmp_path / "m"), config.tiny_qwen2(64), seed=2)
  gen = GeneratorInstance(path, max_num_seqs=64, max_model_len=128, seed=0)
  prompts = [(i, [1] + [4 + (7 * i + j) % 40 for j in range(60)]) for i in range(96)]
  samples = list(gen.generate(prompts, Sampling(max_tokens=8), seed=3))
  assert sorted(s.prompt_id for s in samples) == list(range(96))
  # close() frees the engine; using the instance afterwards says so.
  gen.close()
  gen.close()  # idempotent
  with pytest.raises(RuntimeError, match="closed"):
    list(gen.generate(prompts[:1], Sampling(max_tokens=2), seed=3))
  with pytest.raises(RuntimeError, match="closed"):
    gen.update_weights({}, 5)


def test_length_hints_admit_one_sample_per_prompt_first_then_by_their_siblings(engine):
  """Three prompts, two samples each, one in flight: every group's first sample
  runs first (by prior), then the rest longest-estimate first, where a finished
  sibling's length has replaced most of the prior. EOS is ignored and every
  request has its own max_tokens, so each length is known."""
  from streamrl.scheduling.siblings import LengthHint

  gen, _, _ = engine
  prompts = {"a": [1, 5, 6], "b": [1, 7, 8, 9], "c": [1, 10]}
  priors, lengths = {"a": 10, "b": 5, "c": 1}, {"a": 2, "b": 20, "c": 3}
  reqs = [
      (k, prompts[g], lengths[g], LengthHint(g, priors[g]))
      for k, g in enumerate(["a", "a", "b", "b", "c", "c"])
  ]
  sampling, seed = Sampling(max_tokens=24), 0
  hinted = list(gen.generate(reqs, sampling, seed=seed, max_in_flight=1, ignore_eos=True))
  # Estimates after the probes: a (10 + 2) / 2 = 6, b (5 + 20) / 2 = 12.5, c (1 + 3) / 2 = 2.
  assert [s.prompt_id for s in hinted] == [0, 2, 4, 3, 1, 5]
  plain = {
      s.prompt_id: s
      for s in gen.generate([r[:3] for r in reqs], sampling, seed=seed, ignore_eos=True)
  }
  for s in hinted:  # per-request seeds: the order changes nothing else
    assert s.token_ids == plain[s.prompt_id].token_ids and len(s.token_ids) == reqs[s.prompt_id][2]
  with pytest.raises(ValueError, match="every request"):
    list(gen.generate([reqs[0], reqs[1][:3]], sampling, seed=seed))
