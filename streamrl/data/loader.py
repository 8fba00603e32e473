"""Prompt batches through grain, with a checkpointable position.

The pipeline is `range(n) -> shuffle(seed) -> batch(drop_remainder) ->
repeat(num_epochs)`: grain reshuffles every epoch with a seed derived from
`seed` and the epoch, and batching *before* repeating keeps every batch inside
one epoch, so a batch never holds the same prompt twice (GRPO groups samples
by `prompt_id`). With `drop_remainder=True` (the default, for a fixed batch
size) each epoch leaves out `n % batch_size` prompts, different ones each
epoch.

The iterator state is grain's (`{"next_index": k}`, a plain dict) plus a
description of the dataset, so restoring into a loader built on other data
or another batch size is refused instead of silently reading other prompts.
"""

from __future__ import annotations

import dataclasses
import logging
import zlib
from typing import Any, Iterator, Sequence

import grain

from streamrl.data import tokenizer as char_tokenizer
from streamrl.data.dataset import TRUNCATION_MODES
from streamrl.data.tasks import Example
from streamrl.errors import UserError

_log = logging.getLogger(__name__)


def _fingerprint(examples: Sequence[Example]) -> int:
  """CRC32 over ids and prompts: cheap, stable across processes."""
  crc = 0
  for ex in examples:
    crc = zlib.crc32(f"{ex.prompt_id}\x00{ex.prompt}\x01".encode(), crc)
  return crc


class PromptLoader(Iterator[list[Example]]):
  """Iterates over batches (lists) of Examples in a seeded, resumable order.

  Args:
    examples: the dataset.
    batch_size: prompts per batch.
    seed: shuffle seed (the order is a pure function of seed and position).
    num_epochs: None repeats forever; otherwise StopIteration after that many
      passes.
    shuffle: False keeps the dataset order (every epoch the same).
    drop_remainder: drop the last partial batch of each epoch.
  """

  def __init__(
      self,
      examples: Sequence[Example],
      batch_size: int,
      seed: int,
      num_epochs: int | None = None,
      *,
      shuffle: bool = True,
      drop_remainder: bool = True,
  ):
    if not examples:
      raise ValueError("PromptLoader got an empty dataset; check the data " "source config.")
    if batch_size < 1:
      raise ValueError(f"batch_size={batch_size} must be at least 1.")
    if drop_remainder and batch_size > len(examples):
      raise ValueError(
          f"batch_size={batch_size} is larger than the dataset "
          f"({len(examples)} prompts); use more prompts or a smaller batch."
      )
    if num_epochs is not None and num_epochs < 1:
      raise ValueError(f"num_epochs={num_epochs} must be >= 1 or None.")
    self._examples = list(examples)
    self._desc = {
        "num_examples": len(self._examples),
        "batch_size": int(batch_size),
        "seed": int(seed),
        "num_epochs": num_epochs,
        "shuffle": bool(shuffle),
        "drop_remainder": bool(drop_remainder),
        "fingerprint": _fingerprint(self._examples),
    }
    ds = grain.MapDataset.range(len(self._examples))
    if shuffle:
      ds = ds.shuffle(seed=seed)
    ds = ds.batch(batch_size, drop_remainder=drop_remainder, batch_fn=list)
    ds = ds.repeat(num_epochs)
    # No reader threads: indices are cheap, and threads would compete for
    # the few CPU cores the generator and trainer need.
    self._iter = iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))
    self.batches_per_epoch = (
        len(self._examples) // batch_size
        if drop_remainder
        else -(-len(self._examples) // batch_size)
    )

  def __iter__(self) -> "PromptLoader":
    return self

  def __next__(self) -> list[Example]:
    indices = next(self._iter)
    return [self._examples[int(i)] for i in indices]

  def get_state(self) -> dict[str, Any]:
    """JSON-serialisable position; `set_state` on an equal loader resumes."""
    return {"grain": dict(self._iter.get_state()), **self._desc}

  def set_state(self, state: dict[str, Any]) -> None:
    """Moves to a position saved by `get_state`.

    Raises ValueError if the state belongs to a different dataset, batch
    size, seed or epoch setting.
    """
    saved = {k: state.get(k) for k in self._desc}
    if saved != self._desc:
      diff = sorted(k for k in self._desc if saved[k] != self._desc[k])
      raise ValueError(
          f"The saved data-iterator state does not match this loader "
          f"(differs in {diff}); resume with the same data config or start a "
          "new workdir."
      )
    self._iter.set_state(dict(state["grain"]))


def make_prompts(batch: Sequence[Example], tokenizer: Any = None) -> list[tuple[int, list[int]]]:
  """Token ids for the generator: `[(prompt_id, token_ids), ...]`.

  Args:
    batch: Examples.
    tokenizer: None for the character tokenizer (`[BOS] + encode(prompt)`);
      otherwise anything with `encode(text)` that adds the model's own special
      tokens — a `tokenizers.Tokenizer` (returns an Encoding with `.ids`) or
      a `transformers` tokenizer (returns a list).
  """
  out = []
  for ex in batch:
    if tokenizer is None or tokenizer is char_tokenizer:
      ids = [char_tokenizer.BOS_ID] + char_tokenizer.encode(ex.prompt)
    else:
      enc = tokenizer.encode(ex.prompt)
      ids = list(getattr(enc, "ids", enc))
    out.append((ex.prompt_id, [int(i) for i in ids]))
  return out


def make_requests(examples: Sequence[Example], tokenizer, group_size: int):
  """One generator request per sample: id = position * group_size + k.

  Returns the (request id, prompt token ids) pairs and {request id: Example}.
  """
  requests, by_id = [], {}
  for j, ex in enumerate(examples):
    ids = ex.prompt_token_ids or tokenizer.encode_prompt(ex.prompt)
    for k in range(group_size):
      requests.append((j * group_size + k, ids))
      by_id[j * group_size + k] = ex
  return requests, by_id


def _cut(ids: list[int], budget: int, mode: str) -> list[int]:
  """`ids` cut to `budget` tokens: `left` drops the start, `right` the end,
  `middle` the middle (the start and the end kept, half the budget each)."""
  if mode == "left":
    return ids[len(ids) - budget :]
  if mode == "right":
    return ids[:budget]
  head = (budget + 1) // 2
  return ids[:head] + ids[len(ids) - (budget - head) :]


def fit_prompts(
    examples: Sequence[Example],
    tokenizer,
    *,
    max_model_len: int,
    max_tokens: int,
    truncation: str = "drop",
    what: str = "training",
) -> list[Example]:
  """The examples whose prompt leaves room for `max_tokens` generated tokens
  in `max_model_len` (the engine refuses a longer one mid-run).

  A prompt that does not fit is dropped (`truncation="drop"`, counted and
  logged once with the setting to raise), cut to fit (`left`, `right`,
  `middle`: its token ids kept in `Example.prompt_token_ids`), or refused
  (`error`: a UserError naming the count and the settings). `tokenizer` is
  anything with `encode_prompt(prompt) -> ids`; `what` names the set in the
  messages. UserError as well when every prompt is too long to keep.
  """
  if truncation not in TRUNCATION_MODES:
    raise UserError(f"task.truncation={truncation!r} is unknown; use one of {TRUNCATION_MODES}.")
  budget = max_model_len - max_tokens
  kept, over, longest = [], 0, 0
  for ex in examples:
    ids = list(ex.prompt_token_ids or tokenizer.encode_prompt(ex.prompt))
    if len(ids) <= budget:
      kept.append(ex)
      continue
    over += 1
    longest = max(longest, len(ids))
    if truncation in ("left", "right", "middle"):
      kept.append(dataclasses.replace(ex, prompt_token_ids=tuple(_cut(ids, budget, truncation))))
  if not over:
    return list(examples)
  where = (
      f"longer than {budget} tokens (engine.max_model_len={max_model_len} minus "
      f"sampling.max_tokens={max_tokens}; the longest has {longest})"
  )
  if truncation == "error" or not kept:
    raise UserError(
        f"{over} of {len(examples)} {what} prompts are {where}; raise engine.max_model_len to "
        f"at least {longest + max_tokens}, lower sampling.max_tokens, or set task.truncation "
        "to drop, left, right or middle."
    )
  if truncation == "drop":
    _log.warning(
        "Dropped %d of %d %s prompts %s; raise engine.max_model_len to at least %d to keep "
        "them, or set task.truncation=left/right/middle to cut them instead.",
        over,
        len(examples),
        what,
        where,
        longest + max_tokens,
    )
  else:
    _log.warning(
        "Cut %d of %d %s prompts %s to %d tokens (task.truncation=%s).",
        over,
        len(examples),
        what,
        where,
        budget,
        truncation,
    )
  return kept
