"""Character-level tokenizer for the tiny default policy.

One token per character, built with the `tokenizers` library (nothing is
downloaded). Ids are fixed:

  0 `<pad>`, 1 `<bos>`, 2 `<eos>`, 3 `<unk>`, then `CHARS` in order, then
  `<unusedK>` fillers up to `VOCAB_SIZE` (64) so the tiny model's embedding
  table has a round size.

`encode` adds no special tokens and refuses characters outside the vocabulary
(a silent `<unk>` would make a synthetic task unlearnable without anyone
noticing). `save_hf_tokenizer` writes the files `transformers.AutoTokenizer`
and vLLM need; the saved tokenizer prepends `<bos>` when asked to add special
tokens, which matches `make_prompts` in `streamrl/data/loader.py`.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Iterable, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<bos>", "<eos>", "<unk>"
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)

# Everything the synthetic tasks use, plus a few symbols for small variations.
# No '<' or '>': they would make text like "<eos>" ambiguous.
CHARS = "0123456789abcdefghijklmnopqrstuvwxyz :=+-,()[]./*|#"
VOCAB_SIZE = 64

_NUM_REAL = len(SPECIAL_TOKENS) + len(CHARS)
assert _NUM_REAL <= VOCAB_SIZE, "CHARS no longer fits in VOCAB_SIZE"
assert len(set(CHARS)) == len(CHARS), "CHARS has duplicates"


def vocab() -> dict[str, int]:
  """Returns the full token -> id map (VOCAB_SIZE entries)."""
  tokens = list(SPECIAL_TOKENS) + list(CHARS)
  tokens += [f"<unused{k}>" for k in range(VOCAB_SIZE - len(tokens))]
  return {tok: i for i, tok in enumerate(tokens)}


def build_tokenizer() -> tokenizers.Tokenizer:
  """Builds the character tokenizer as a `tokenizers.Tokenizer`.

  Its `encode(text)` prepends `<bos>` by default (post-processor), like the
  saved HF tokenizer; use `encode(text, add_special_tokens=False)` or this
  module's `encode` for the bare character ids.
  """
  tok = tokenizers.Tokenizer(models.WordLevel(vocab(), unk_token=UNK_TOKEN))
  # Every character is its own word; Split with an always-matching regex
  # keeps spaces as tokens (Whitespace pre-tokenizers would drop them).
  tok.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
  # Fuse joins tokens without the space WordLevel would put between them.
  tok.decoder = decoders.Fuse()
  special = [
      tokenizers.AddedToken(t, special=True, normalized=False) for t in vocab() if t.startswith("<")
  ]
  tok.add_special_tokens(special)
  tok.post_processor = processors.TemplateProcessing(
      single=f"{BOS_TOKEN} $A",
      pair=f"{BOS_TOKEN} $A $B:1",
      special_tokens=[(BOS_TOKEN, BOS_ID)],
  )
  return tok


@functools.cache
def _char_to_id() -> dict[str, int]:
  return {c: i for c, i in vocab().items() if len(c) == 1}


@functools.cache
def _id_to_char() -> dict[int, str]:
  return {i: c for c, i in _char_to_id().items()}


def encode(text: str) -> list[int]:
  """Maps each character of `text` to its id; no special tokens are added.

  Raises ValueError naming the characters that are not in the vocabulary.
  """
  table = _char_to_id()
  try:
    return [table[c] for c in text]
  except KeyError:
    bad = sorted({c for c in text if c not in table})
    raise ValueError(
        f"Text {text[:40]!r} has characters {bad} that the character "
        f"tokenizer does not know; use only characters from {CHARS!r}."
    ) from None


def decode(ids: Iterable[int]) -> str:
  """Turns ids back into text.

  Stops at the first `<eos>`; drops `<pad>`, `<bos>` and other non-character
  ids (a sampled `<unused3>` says nothing about the answer, so it is skipped
  rather than raising).
  """
  table = _id_to_char()
  out = []
  for i in ids:
    i = int(i)
    if i == EOS_ID:
      break
    c = table.get(i)
    if c is not None:
      out.append(c)
  return "".join(out)


def save_hf_tokenizer(directory: str | os.PathLike, *, model_max_length: int = 4096) -> str:
  """Writes tokenizer.json, tokenizer_config.json, special_tokens_map.json.

  `transformers.AutoTokenizer.from_pretrained(directory)` then loads a fast
  tokenizer with the same ids, bos/eos/pad/unk set. Returns `directory`.
  """
  directory = os.fspath(directory)
  os.makedirs(directory, exist_ok=True)
  build_tokenizer().save(os.path.join(directory, "tokenizer.json"))
  special_map = {
      "bos_token": BOS_TOKEN,
      "eos_token": EOS_TOKEN,
      "pad_token": PAD_TOKEN,
      "unk_token": UNK_TOKEN,
  }
  config = {
      "tokenizer_class": "PreTrainedTokenizerFast",
      "model_max_length": model_max_length,
      "add_bos_token": True,
      "add_eos_token": False,
      "clean_up_tokenization_spaces": False,
      "padding_side": "left",
      **special_map,
  }
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump(config, f, indent=2)
  with open(os.path.join(directory, "special_tokens_map.json"), "w") as f:
    json.dump(special_map, f, indent=2)
  return directory


class Tokenizer:
  """Prompt encoding / response decoding with a model directory's tokenizer.json."""

  def __init__(self, model_dir: str):
    self._tok = tokenizers.Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))

  def encode_prompt(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=True).ids

  def decode(self, ids: Sequence[int]) -> str:
    return self._tok.decode(list(ids), skip_special_tokens=True)
