"""(prompt tokens, output length) pairs: the JSONL file, synthetic pairs, fingerprints.

Pairs file: one JSON object per line, `{"prompt_ids": [int, ...], "length": int}`
where `length` is the number of generated tokens (EOS included). The RL loop
appends to it after every iteration (`append_pairs`), and the ranker trains on
it offline and refreshes on its most recent lines (`load_pairs(last=...)`).
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
from typing import Iterable, Mapping, Sequence

Pair = tuple[tuple[int, ...], int]  # (prompt token ids, output length)


def _check_pair(prompt_ids, length, where: str) -> Pair:
  if not isinstance(prompt_ids, (list, tuple)) or not all(
      isinstance(t, int) and t >= 0 for t in prompt_ids
  ):
    raise ValueError(
        f"{where}: prompt_ids must be a list of non-negative ints; fix or drop that pair."
    )
  if isinstance(length, bool) or not isinstance(length, int) or length < 0:
    raise ValueError(
        f"{where}: length must be a non-negative int, got {length!r}; fix or drop that pair."
    )
  return tuple(prompt_ids), int(length)


def append_pairs(path: str | os.PathLike, pairs: Iterable[Pair]) -> int:
  """Appends pairs to a JSONL file (created with its directory if missing).

  Returns the number of pairs written. Each line is flushed as a whole, so a
  reader never sees half a pair from a finished call.
  """
  path = os.fspath(path)
  parent = os.path.dirname(path)
  if parent:
    os.makedirs(parent, exist_ok=True)
  lines = []
  for n, (ids, length) in enumerate(pairs):
    ids, length = _check_pair(list(int(t) for t in ids), int(length), f"pair {n}")
    lines.append(json.dumps({"prompt_ids": list(ids), "length": length}, separators=(",", ":")))
  with open(path, "a") as f:
    f.write("".join(line + "\n" for line in lines))
  return len(lines)


def load_pairs(path: str | os.PathLike, *, last: int | None = None) -> list[Pair]:
  """Reads pairs from a JSONL file; `last` keeps only the most recent lines."""
  path = os.fspath(path)
  if not os.path.exists(path):
    raise FileNotFoundError(
        f"pairs file {path} does not exist; generate pairs first (the RL loop "
        "appends them) or set config.data.pairs_path=None for synthetic pairs."
    )
  with open(path) as f:
    lines = collections.deque(f, maxlen=last) if last else f.readlines()
  out = []
  for n, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError:
      raise ValueError(f"{path}: line {n + 1} of the read lines is not JSON; remove it.") from None
    if not isinstance(row, dict) or "prompt_ids" not in row or "length" not in row:
      raise ValueError(f"{path}: line {n + 1} of the read lines needs keys prompt_ids and length.")
    out.append(_check_pair(row["prompt_ids"], row["length"], f"{path} line {n + 1}"))
  return out


def synthetic_pairs(n: int, seed: int, *, first_id: int = 0, **task_kwargs) -> list[Pair]:
  """Pairs from the synthetic tasks: ([BOS] + prompt chars, answer length + 1 for EOS).

  A stand-in for real generations before the RL loop has produced any: the
  tasks' answer length is a function of the prompt, so this is what a policy
  that solves the tasks would generate.
  """
  from streamrl.data import tasks, tokenizer  # Local: keeps this module light.

  pairs = []
  for ex in tasks.make_examples(n, seed, first_id=first_id, **task_kwargs):
    ids = [tokenizer.BOS_ID] + tokenizer.encode(ex.prompt)
    pairs.append((tuple(ids), len(tokenizer.encode(ex.answer)) + 1))
  return pairs


def fingerprint_vocab(vocab: Mapping[str, int]) -> str:
  """Stable short hash of a token -> id map (16 hex chars)."""
  items = sorted((str(k), int(v)) for k, v in vocab.items())
  return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


def fingerprint_tokenizer_dir(model_dir: str | os.PathLike) -> tuple[int, str]:
  """(vocab size, fingerprint) of the HF tokenizer.json in a model directory.

  Vocab size counts the model vocabulary plus added tokens.
  """
  path = os.path.join(os.fspath(model_dir), "tokenizer.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} does not exist; point at the policy's HF model directory.")
  with open(path) as f:
    tok = json.load(f)
  vocab = dict(tok.get("model", {}).get("vocab", {}) or {})
  for added in tok.get("added_tokens", []):
    vocab[added["content"]] = added["id"]
  if not vocab:
    raise ValueError(
        f"{path} has no model.vocab; only word-level/BPE tokenizer.json files are supported."
    )
  return max(vocab.values()) + 1, fingerprint_vocab(vocab)


def char_tokenizer_fingerprint() -> tuple[int, str]:
  """(vocab size, fingerprint) of the project's character tokenizer."""
  from streamrl.data import tokenizer

  return tokenizer.VOCAB_SIZE, fingerprint_vocab(tokenizer.vocab())


def split_pairs(
    pairs: Sequence[Pair], eval_fraction: float, seed: int
) -> tuple[list[Pair], list[Pair]]:
  """Random (train, eval) split of pairs; eval gets round(eval_fraction * n)."""
  import numpy as np

  perm = np.random.default_rng(seed).permutation(len(pairs))
  n_eval = int(round(eval_fraction * len(pairs)))
  return [pairs[i] for i in perm[n_eval:]], [pairs[i] for i in perm[:n_eval]]
