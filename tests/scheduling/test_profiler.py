"""The profiler measures a real (tiny, in-process) vLLM instance at fixed output lengths."""

import pytest

from streamrl.scheduling.latency import LatencyProfile

pytestmark = [pytest.mark.engine]


@pytest.fixture(scope="module")
def instance(tmp_path_factory):
  # Imported here, not at collection: importing vLLM takes seconds.
  pytest.importorskip("vllm")
  from streamrl.generator.vllm_engine import GeneratorInstance
  from streamrl.models import config, tiny

  path = tiny.build_tiny_model_dir(
      str(tmp_path_factory.mktemp("policy")), config.tiny_qwen2(64), seed=3
  )
  return GeneratorInstance(path, max_num_seqs=8, max_model_len=64, seed=0)


def test_profile_is_valid_and_saved(instance, tmp_path):
  from streamrl.generator.config import Sampling
  from streamrl.generator.profiler import profile_instance

  path = tmp_path / "profile.json"
  # Raises inside if any request stops before its fixed length (EOS not ignored).
  profile = profile_instance(
      instance,
      [4, 1],
      prompt_len=4,
      gen_lens=(2, 4, 6),
      prefill_prompt_len=63,  # Fits only with the one token a prefill cell decodes.
      prefill_batch=2,
      reps=2,
      name="tiny",
      path=str(path),
  )
  assert profile.batch_sizes == (1, 4)
  assert all(p > 0 for p in profile.ptl_s)
  assert profile.prefill_s_per_token >= 0
  assert profile.context_s_per_token >= 0
  assert len(profile.ptl_rel_se) == 2 and all(e >= 0 for e in profile.ptl_rel_se)
  assert LatencyProfile.from_json(path) == profile
  # Fixed-length decoding is per request: normal requests may stop at EOS as before.
  samples = list(instance.generate([(0, [1, 5, 6])], Sampling(max_tokens=4), seed=0))
  assert len(samples) == 1 and 1 <= len(samples[0].token_ids) <= 4


def test_bad_arguments_refused(instance):
  from streamrl.generator.profiler import profile_instance

  with pytest.raises(ValueError, match="max_num_seqs"):
    profile_instance(instance, [16])
  with pytest.raises(ValueError, match="increasing"):
    profile_instance(instance, [1], gen_lens=(6, 2))
  with pytest.raises(ValueError, match="two or more"):
    profile_instance(instance, [1], gen_lens=(6,))
  with pytest.raises(ValueError, match="max_model_len"):
    profile_instance(instance, [1], prompt_len=60, gen_lens=(2, 10))
  with pytest.raises(ValueError, match="context_prompt_len"):
    profile_instance(instance, [1], gen_lens=(2, 10), prefill_prompt_len=16, context_prompt_len=60)


def test_joint_fit_recovers_the_costs():
  # The cell model with known PTL(BS), context cost and per-cell set-up
  # times; the fit must return them (it is exact on noiseless cells).
  import itertools

  import numpy as np

  from streamrl.generator.profiler import _fit

  sizes, p0, contexts = [1, 2, 4], 16, [40, 64]
  ptl = {1: 2e-3, 2: 2.4e-3, 4: 3.1e-3}
  ctx = 7e-7
  rng = np.random.default_rng(0)
  setup = {}
  cells = [(b, p0, n) for b, n in itertools.product(sizes, (8, 24, 40))]
  cells += [(4, p, n) for p, n in itertools.product(contexts, (8, 24, 40))]

  def time_of(b, p, n):
    a = setup.setdefault((b, p), float(rng.uniform(0.01, 0.05)))
    return a + n * (ptl[b] + ctx * b * (p - p0))

  got, got_ctx = _fit(cells, [time_of(*c) for c in cells], sizes, p0, contexts)
  np.testing.assert_allclose(got, [ptl[b] for b in sizes], rtol=1e-6)
  assert got_ctx == pytest.approx(ctx, rel=1e-6)
  # Without context cells the context term is not fitted.
  plain = [c for c in cells if c[1] == p0]
  got, got_ctx = _fit(plain, [time_of(*c) for c in plain], sizes, p0, [])
  np.testing.assert_allclose(got, [ptl[b] for b in sizes], rtol=1e-6)
  assert got_ctx == 0.0
