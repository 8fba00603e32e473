"""experiments/bench/bench_peers.py without its peers: the prompt ids TRL and Tunix
are given, and the report. Neither TRL nor Tunix is needed (CI has neither);
the tokenizer calls below are the ones their trainers make."""

import os
import re

import pytest
import transformers

from experiments.bench import bench_peers
from streamrl.trainer import setup as setup_lib
from streamrl.data import tokenizer as tokenizer_lib

pytestmark = [pytest.mark.unit]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """The bench's settings, its first prompts in StreamRL's order of draw, and
  the tiny policy's tokenizer (what the warm start saves)."""
  s = bench_peers.settings_for(seed=0, iterations=2, num_eval=16, eval_every=1)
  model_dir = tokenizer_lib.save_hf_tokenizer(tmp_path_factory.mktemp("policy"))
  examples = bench_peers.drawn_examples(s)
  tok = setup_lib.make_tokenizer(s, model_dir)
  hf_tok = transformers.AutoTokenizer.from_pretrained(model_dir)
  prompt_ids = [list(tok.encode_prompt(ex.prompt)) for ex in examples]
  return s, examples, hf_tok, prompt_ids


def test_the_peers_draw_streamrls_prompts_in_its_order(setup):
  s, examples, _, _ = setup
  assert len(examples) == s.trainer.num_iterations * bench_peers.PROMPTS
  from streamrl.data.loader import PromptLoader

  train_examples, _ = setup_lib.load_examples(s)
  loader = PromptLoader(train_examples, s.trainer.prompts_per_iteration, seed=s.seed)
  assert [ex.prompt for ex in examples] == [ex.prompt for ex in next(loader) + next(loader)]


def test_trl_tokenizes_the_prompts_into_streamrls_ids(setup):
  _, _, hf_tok, prompt_ids = setup
  assert all(ids[0] == hf_tok.bos_token_id for ids in prompt_ids)  # StreamRL's prompts hold <bos>
  prompts = [bench_peers.peer_prompt(hf_tok, ids) for ids in prompt_ids]
  # TRL 1.16, GRPOTrainer._tokenize_prompts, text prompts: processing_class(text=prompts).
  assert hf_tok(text=prompts)["input_ids"] == prompt_ids
  assert bench_peers.trl_prompt_ids(hf_tok, prompts) == prompt_ids
  bench_peers.check_trl_prompts(hf_tok, prompts, prompt_ids)
  # Tunix's sampler encodes with the tokenizer's defaults too (then puts a
  # <bos> in front and drops a doubled one).
  assert [hf_tok.encode(p) for p in prompts] == prompt_ids


def test_prompts_decoded_with_their_bos_would_reach_trl_with_two(setup):
  # What the bench did before: TRL's call adds a second <bos>, which the check notices.
  _, _, hf_tok, prompt_ids = setup
  prompts = [hf_tok.decode(ids) for ids in prompt_ids[:4]]
  bos = hf_tok.bos_token_id
  assert all(ids[:2] == [bos, bos] for ids in bench_peers.trl_prompt_ids(hf_tok, prompts))
  with pytest.raises(RuntimeError, match="TRL would tokenize prompt 0"):
    bench_peers.check_trl_prompts(hf_tok, prompts, prompt_ids[:4])


def _system(samples_per_s, accs, seconds):
  curve = [
      dict(samples=128 * i, train_s=t, acc=a, acc_greedy=a)
      for i, (a, t) in enumerate(zip(accs, seconds))
  ]
  return dict(
      samples_per_s=samples_per_s,
      tokens_per_s=10 * samples_per_s,
      train_s=seconds[-1],
      startup_s=1.0,
      curve=curve,
      unmatched=["a setting"],
  )


def test_the_report_compares_streamrl_with_each_peer(setup, tmp_path, capsys):
  s = setup[0]
  results = {
      "streamrl": dict(
          _system(120.0, [0.2, 0.3], [0.0, 2.0]),
          stalls=0,
          stall_s=0.0,
          steady_samples_per_s=120.0,
      ),
      "trl": _system(40.0, [0.2, 0.28], [0.0, 6.0]),
      "tunix": _system(20.0, [0.2, 0.32], [0.0, 12.0]),
  }
  line = bench_peers.report(results, s, str(tmp_path))
  got = dict(kv.split("=") for kv in line.split()[1:])
  assert got["streamrl_over_trl_samples_per_s"] == "3.00"
  assert got["streamrl_over_tunix_samples_per_s"] == "6.00"
  assert got["accuracy_delta_trl_equal_samples"] == "2.0"
  assert got["accuracy_delta_tunix_equal_samples"] == "-2.0"
  # At StreamRL's 2 s, Tunix's curve is a sixth of the way to 0.32.
  assert got["accuracy_delta_tunix_equal_time"] == "8.0"
  assert os.path.exists(tmp_path / "accuracy_vs_time_seed0.png")
  out = capsys.readouterr().out
  assert re.search(r"unmatched \(tunix\): a setting", out)


def test_streamrl_alone_reports_its_own_keys_and_bounds(setup, tmp_path):
  s = setup[0]
  streamrl = dict(
      _system(120.0, [0.2, 0.3], [0.0, 2.0]),
      stalls=0,
      stall_s=0.0,
      steady_samples_per_s=120.0,
      time_split=dict(generation=1.0, training=2.0, weight_update=0.0, generation_wait=0.0),
  )
  line = bench_peers.report({"streamrl": streamrl}, s, str(tmp_path))
  got = dict(kv.split("=") for kv in line.split()[1:])
  assert not any("trl" in k or "tunix" in k for k in got)
  assert got["streamrl_samples_per_s"] == "120.0"
  # 240 samples: over the trainer's 2 s, and over the 1.5 s mean of both parts.
  assert got["streamrl_overlap_bound_samples_per_s"] == "120.0"
  assert got["streamrl_split_bound_samples_per_s"] == "160.0"
