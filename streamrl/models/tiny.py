"""The built-in policies (the tiny default, the benchmark model): random init
and the character tokenizer (or a real SentencePiece one), saved as a normal
HF directory (config.json, model.safetensors, tokenizer files) so the trainer
and vLLM load it like any real checkpoint. Nothing is downloaded."""

from __future__ import annotations

import os

from flax import nnx

from streamrl.data import tokenizer as tok
from streamrl.models import config as config_lib
from streamrl.models import hf
from streamrl.models.transformer import Transformer

# The SentencePiece model's special ids (Llama / Mistral): <unk> 0, <s> 1,
# </s> 2; it has no pad token, so <unk> pads.
SENTENCEPIECE_PAD_ID, SENTENCEPIECE_BOS_ID, SENTENCEPIECE_EOS_ID = 0, 1, 2


def build_tiny_model_dir(
    path: str,
    cfg: config_lib.ModelConfig | None = None,
    seed: int = 0,
    model: Transformer | None = None,
    tokenizer: str = "chars",
    chat_template: str = tok.TURNS_TEMPLATE,
) -> str:
  """Writes a built-in model (random init unless `model` is given) to `path`,
  with the character tokenizer or (`tokenizer="sentencepiece"`) the real
  32,000-piece one mistral-common ships, with `chat_template`."""
  cfg = cfg or config_lib.tiny_qwen2(tok.VOCAB_SIZE)
  model = model or Transformer(cfg, rngs=nnx.Rngs(seed))
  if tokenizer == "sentencepiece":
    hf.save_hf(
        model,
        path,
        bos_token_id=SENTENCEPIECE_BOS_ID,
        eos_token_id=SENTENCEPIECE_EOS_ID,
        pad_token_id=SENTENCEPIECE_PAD_ID,
    )
    tok.save_sentencepiece_tokenizer(path, chat_template=chat_template)
    return os.fspath(path)
  hf.save_hf(model, path, bos_token_id=tok.BOS_ID, eos_token_id=tok.EOS_ID, pad_token_id=tok.PAD_ID)
  tok.save_hf_tokenizer(path, model_max_length=cfg.max_position_embeddings)
  return os.fspath(path)
