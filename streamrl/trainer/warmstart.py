"""The run's policy directory: a local HF checkpoint, or a warm-started built-in one.

With an empty `model.path` the built-in policy of `model.tiny` (random init,
the tokenizer of `model.tokenizer`; `streamrl/models/tiny.py`) gets a short
supervised warm-up on the task's own demonstrations
(`streamrl/trainer/sft.py`), is written as an HF directory into the workdir
under a name derived from what it depends on, and is reused on the next run.
With the SentencePiece tokenizer the prompts are the chat template's
renderings, as the run encodes them (`data.tokenizer.Tokenizer`).
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

from streamrl.data.config import Task
from streamrl.models.config import Model
from streamrl.trainer.config import Warmstart
from streamrl.data import calc as calc_lib
from streamrl.data import tasks
from streamrl.data import tokenizer as char_tok
from streamrl.data.tokenizer import Tokenizer
from streamrl.models import config as model_config_lib
from streamrl.models import hf, tiny

log = logging.getLogger(__name__)

_TINY = {
    "qwen2": model_config_lib.tiny_qwen2,
    "llama": model_config_lib.tiny_llama,
    "qwen3": model_config_lib.tiny_qwen3,
    "qwen2_mid": model_config_lib.mid_qwen2,
}
# The chat template written with the SentencePiece tokenizer (the tiny
# shapes keep the plain turn template).
_CHAT_TEMPLATES = {"qwen2_mid": char_tok.CHATML_TEMPLATE}
# The tiny model's vocabulary follows its tokenizer (`model.tokenizer`).
_VOCAB = {"chars": char_tok.VOCAB_SIZE, "sentencepiece": 32000}


def fingerprint(obj) -> str:
  return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


def tiny_model_dir(
    model: Model, warm: Warmstart, task: Task, *, seed: int, workdir: str, trace=None, calc=None
) -> str:
  """Where `prepare_model_dir` keeps the warm-started tiny policy of these
  settings: <workdir>/warmstart-<key>, the key covering only what changes its
  weights (not, say, the eval set size). Nothing is created or checked."""
  work = tasks.work_unit(model.tokenizer)
  key = fingerprint(
      {
          "tiny": model.tiny,
          # Only when not the default, so the caches of earlier runs keep their names;
          # a real tokenizer's prompts are its chat template's renderings.
          **(
              {
                  "tokenizer": model.tokenizer,
                  "template": _CHAT_TEMPLATES.get(model.tiny, char_tok.TURNS_TEMPLATE),
                  "chat": [task.chat_template, task.system_prompt, task.chat_template_kwargs],
              }
              if model.tokenizer != "chars"
              else {}
          ),
          "warm": dataclasses.asdict(warm),
          "ops": list(task.ops),
          "max_answer_len": task.max_answer_len,
          "seed": seed,
          **(
              {
                  "trace": dataclasses.asdict(trace),
                  "trace_format": tasks.TRACE_FORMAT,
                  # Only when not the character tokenizer's, so its caches keep their names.
                  **({"work": work} if work != tasks.WORK else {}),
              }
              if trace is not None
              else {}
          ),
          **(
              {"calc": dataclasses.asdict(calc), "calc_format": calc_lib.FORMAT}
              if calc is not None
              else {}
          ),
      }
  )
  return os.path.join(workdir, f"warmstart-{key}")


def prepare_model_dir(
    model: Model,
    warm: Warmstart,
    task: Task,
    *,
    seed: int,
    workdir: str,
    train_examples: Sequence,
    trace=None,
    calc=None,
) -> str:
  """The policy's HF directory: `model.path`, or the warm-started built-in one.

  `trace` (a `tasks.TraceConfig`) is the work-trace shape the warm-up
  teaches for trace examples (`streamrl.trainer.setup.trace_config`); `calc` (a
  `data.calc.CalcConfig`) the share of tool trajectories in the targets of
  the agentic sums."""
  if model.path:
    hf.read_config(model.path)  # clear error for a bad path / arch
    return model.path
  path = tiny_model_dir(model, warm, task, seed=seed, workdir=workdir, trace=trace, calc=calc)
  if os.path.isfile(os.path.join(path, "model.safetensors")):
    log.info("Reusing warm-started policy %s", path)
    return path
  cfg = _TINY[model.tiny](_VOCAB[model.tokenizer])
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from streamrl.models.transformer import Transformer  # pylint: disable=g-import-not-at-top
  from streamrl.trainer import sft  # pylint: disable=g-import-not-at-top

  if warm.steps and model.tokenizer != "chars" and calc is not None:
    raise ValueError(
        "The agentic sums' warm-up writes its tool trajectories with the character "
        "tokenizer; set model.tokenizer=chars (or warmstart.steps=0) with task.kind=calc."
    )
  policy = Transformer(cfg, rngs=nnx.Rngs(seed))
  tmp = f"{path}.tmp{os.getpid()}"
  template = _CHAT_TEMPLATES.get(model.tiny, char_tok.TURNS_TEMPLATE)
  tokenizer = None
  if model.tokenizer != "chars":
    # The tokenizer first: the warm-up encodes its prompts as the run will.
    char_tok.save_sentencepiece_tokenizer(tmp, chat_template=template)
    tokenizer = Tokenizer(
        tmp,
        chat_template=task.chat_template,
        system_prompt=task.system_prompt,
        chat_template_kwargs=task.template_kwargs(),
    )
  if warm.steps:
    if trace is None and any(e.task.startswith("trace-") for e in train_examples):
      raise ValueError(
          "Trace examples need the run's TraceConfig; pass trace=setup.trace_config(s)."
      )
    t0 = time.time()
    phases = warmup_phases(
        warm,
        train_examples,
        seed=seed,
        trace=trace,
        calc=calc,
        tokenizer=tokenizer,
        work=tasks.work_unit(model.tokenizer),
    )
    for steps, pairs in phases:
      seq_len = max(len(p) + len(a) for p, a, *_ in pairs)
      policy, loss = sft.warm_start(
          policy,
          pairs,
          steps=steps,
          batch_size=warm.batch_size,
          lr=warm.lr,
          seq_len=seq_len + 1,
          seed=seed,
          log_every=max(steps // 5, 1),
      )
    log.info("Warm-up: %d steps, final loss %.3f, %.0f s", warm.steps, loss, time.time() - t0)
  tiny.build_tiny_model_dir(
      tmp, cfg, model=policy, tokenizer=model.tokenizer, chat_template=template
  )
  try:
    os.replace(tmp, path)  # Atomic: a reader never sees half a directory.
  except OSError:
    # Another run finished the same warm start first; theirs is identical.
    shutil.rmtree(tmp, ignore_errors=True)
  return path


def warmup_phases(
    warm: Warmstart,
    examples,
    *,
    seed: int,
    trace=None,
    calc=None,
    tokenizer=None,
    work: str = tasks.WORK,
):
  """[(steps, (prompt ids, answer ids[, answer mask]) pairs)] of the warm-up.

  `tokenizer` (a `data.tokenizer.Tokenizer`) encodes them with a real
  tokenizer's chat template (`_encode_pairs`); None: the character tokenizer.
  `work` is the traces' work unit (`tasks.work_unit` of the tokenizer).

  One phase on the synthetic tasks. On the agentic sums two: tool trajectories
  alone for `calc.tool_steps` steps (so the policy learns to copy what is left
  into a call), then the mixture with `calc.tool_fraction` of them for the
  rest (so it mostly answers without the tool, and wrongly). A trajectory's
  observations are the tool's: masked out of the loss.
  """
  rng = np.random.default_rng(seed)
  if tokenizer is not None:
    targets = [tasks.sft_target(e, rng, trace, work) for e in examples]
    return [(warm.steps, _encode_pairs(tokenizer, examples, targets))]
  prompts = [[char_tok.BOS_ID] + char_tok.encode(e.prompt) for e in examples]
  if calc is None:
    answers = [
        char_tok.encode(tasks.sft_target(e, rng, trace, work)) + [char_tok.EOS_ID] for e in examples
    ]
    return [(warm.steps, list(zip(prompts, answers)))]

  def pairs(config):
    out = []
    for p, e in zip(prompts, examples):
      pieces = calc_lib.sft_target(e, rng, config)
      ids = [char_tok.encode(text) for text, _ in pieces]
      mask = [float(trained) for (_, trained), part in zip(pieces, ids) for _ in part]
      out.append((p, [t for part in ids for t in part] + [char_tok.EOS_ID], mask + [1.0]))
    return out

  first = min(calc.tool_steps, warm.steps)
  phases = [(first, pairs(dataclasses.replace(calc, tool_fraction=1.0)))] if first else []
  if warm.steps > first:
    phases.append((warm.steps - first, pairs(calc)))
  return phases


def _encode_pairs(tokenizer: Tokenizer, examples, targets: Sequence[str]) -> list[tuple]:
  """(prompt ids, answer ids + EOS) with a real tokenizer: the answer's ids
  are those of the prompt's rendering followed by the answer, past the
  prompt's (as the policy generates them: SentencePiece gives text at the start
  of an encoding a word-boundary mark it has nowhere else)."""
  out = []
  for e, target in zip(examples, targets):
    prompt = tokenizer.encode_prompt(e.prompt)
    if tokenizer.chat:
      text = tokenizer.render(tokenizer.messages(e.prompt))
      both = tokenizer.encode_text(text + target)
      answer = both[len(prompt) :] if both[: len(prompt)] == prompt else None
    if not tokenizer.chat or answer is None:
      answer = tokenizer.encode_text(target)
    out.append((prompt, answer + [tiny.SENTENCEPIECE_EOS_ID]))
  return out
