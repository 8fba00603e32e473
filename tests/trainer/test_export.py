"""The trained policy as an HF directory (streamrl/trainer/export.py): what
transformers loads from it scores tokens as the trainer does, and the
refusals are one sentence each. launch/export.py and vLLM on the export:
test_export_launch.py."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from streamrl.data import tokenizer as char_tok
from streamrl.errors import UserError
from streamrl.models import safetensors_io, transformer
from streamrl.trainer import export, setup

pytestmark = [pytest.mark.unit]

# Token sequences to score: BOS, then characters of the tiny vocabulary.
SEQUENCES = [[1] + [4 + (5 * i + 3 * j) % 50 for j in range(6 + 7 * i)] for i in range(4)]


def flax_logprobs(model, seq):
  """[len(seq) - 1] logprobs of tokens 1.. under the Flax policy, fp32."""
  logp, _ = transformer.sequence_logprobs(model, jnp.asarray([seq]))
  return np.asarray(logp[0, :-1])


def torch_logprobs(model, seq):
  import torch

  with torch.no_grad():
    logits = model(torch.tensor([seq])).logits[0, :-1].double()
  logp = torch.log_softmax(logits, -1)
  return logp.gather(1, torch.tensor(seq[1:])[:, None])[:, 0].numpy()


@pytest.fixture(scope="module")
def exported(export_run, tmp_path_factory):
  workdir = export_run[0]
  out = str(tmp_path_factory.mktemp("export") / "hf")
  return export.export_checkpoint(workdir, out), out


def test_export_holds_the_trained_actor_and_the_policy_dirs_files(
    export_run, trained_policy, exported
):
  workdir = export_run[0]
  model_dir, policy = trained_policy
  step, out = exported
  assert step == 2 and export.checkpoint_steps(workdir) == [1, 2]
  assert setup.saved_policy_dir(export.read_settings(workdir), workdir) == model_dir
  assert sorted(os.listdir(out)) == [
      "config.json",
      "generation_config.json",
      "model.safetensors",
      "special_tokens_map.json",
      "tokenizer.json",
      "tokenizer_config.json",
  ]
  for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
    with open(os.path.join(out, name), "rb") as a, open(os.path.join(model_dir, name), "rb") as b:
      assert a.read() == b.read(), name
  with open(os.path.join(out, "generation_config.json")) as f:
    assert json.load(f) == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
  # Nothing is left next to the output.
  assert os.listdir(os.path.dirname(out)) == ["hf"]
  # The partial restore reads exactly the actor the trainer saved, and that
  # actor moved off the initial weights.
  restored = export.restore_actor(workdir, model_dir, step)
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(policy)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  initial = safetensors_io.load(os.path.join(model_dir, "model.safetensors"))
  trained = safetensors_io.load(os.path.join(out, "model.safetensors"))
  assert trained.keys() == initial.keys()
  assert any(not np.array_equal(trained[k], initial[k]) for k in trained)


def test_transformers_scores_as_the_trainer(trained_policy, exported):
  import transformers

  model_dir, policy = trained_policy
  _, out = exported
  model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  deltas = [np.abs(torch_logprobs(model, s) - flax_logprobs(policy, s)).max() for s in SEQUENCES]
  print(f"max |transformers - trainer| logprob: {max(deltas):.2e}")
  assert max(deltas) < 1e-4, deltas
  tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  assert tokenizer("12+3=").input_ids == [1] + char_tok.encode("12+3=")
  assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 0)


def test_export_policy_writes_model_dtype(trained_policy, tmp_path):
  model_dir, policy = trained_policy
  out = export.export_policy(
      policy, model_dir=model_dir, out=str(tmp_path / "a" / "bf16"), dtype="bfloat16"
  )
  header, _ = safetensors_io.read_header(os.path.join(out, "model.safetensors"))
  assert {v["dtype"] for v in header.values()} == {"BF16"}
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f)["torch_dtype"] == "bfloat16"
  # A copied generation_config.json wins over the derived one.
  src = tmp_path / "src"
  shutil.copytree(model_dir, src)
  (src / "generation_config.json").write_text('{"eos_token_id": [2, 3], "do_sample": true}')
  out = export.export_policy(policy, model_dir=str(src), out=str(tmp_path / "copied"))
  with open(os.path.join(out, "generation_config.json")) as f:
    assert json.load(f) == {"eos_token_id": [2, 3], "do_sample": True}


def test_refusals_are_one_sentence(export_run, trained_policy, exported, tmp_path):
  workdir = export_run[0]
  model_dir, policy = trained_policy
  _, out = exported
  with pytest.raises(UserError, match=r"workdir .*nowhere does not exist"):
    export.export_checkpoint(str(tmp_path / "nowhere"), str(tmp_path / "x"))
  with pytest.raises(UserError, match=r"has no checkpoint of step 7; pick one of .* 1, 2\.$"):
    export.export_checkpoint(workdir, str(tmp_path / "x"), step=7)
  fresh = tmp_path / "fresh"
  fresh.mkdir()
  shutil.copy(os.path.join(workdir, "config.json"), fresh)
  with pytest.raises(UserError, match=r"has no checkpoints"):
    export.export_checkpoint(str(fresh), str(tmp_path / "x"))
  before = sorted(os.listdir(out))
  with pytest.raises(UserError, match=r"exists and is not empty.*--overwrite"):
    export.export_checkpoint(workdir, out, step=1)
  assert sorted(os.listdir(out)) == before
  with pytest.raises(UserError, match=r"is the run's own policy directory"):
    export.export_policy(policy, model_dir=model_dir, out=model_dir, overwrite=True)
  # A policy directory the checkpoint's actor does not fit (no q/k/v biases),
  # refused rather than restored without the biases.
  llama = tmp_path / "llama"
  shutil.copytree(model_dir, llama)
  config = json.loads((llama / "config.json").read_text())
  config.update(architectures=["LlamaForCausalLM"], model_type="llama")
  (llama / "config.json").write_text(json.dumps(config))
  with pytest.raises(UserError, match=r"lacks, the actor's .*b_k_kn.*not trained from the"):
    export.restore_actor(workdir, llama, 2)
  assert not os.path.exists(tmp_path / "x")


def test_overwrite_replaces_the_directory_whole(export_run, tmp_path):
  workdir = export_run[0]
  out = tmp_path / "hf"
  out.mkdir()
  (out / "stale.bin").write_text("from an older export")
  assert export.export_checkpoint(workdir, str(out), step=1, overwrite=True) == 1
  assert "stale.bin" not in os.listdir(out) and "model.safetensors" in os.listdir(out)
  assert os.listdir(tmp_path) == ["hf"]


def test_a_failed_write_leaves_no_directory(trained_policy, tmp_path, monkeypatch):
  model_dir, policy = trained_policy

  def crash(*args, **kwargs):
    raise OSError("disk full")

  monkeypatch.setattr(export.shutil, "copyfile", crash)
  with pytest.raises(OSError, match="disk full"):
    export.export_policy(policy, model_dir=model_dir, out=str(tmp_path / "hf"))
  assert os.listdir(tmp_path) == []
