"""bench_skew's arms and length sources: the policy's prompts in its own
tokens, the arms' runs on the lockstep clock, the run configs' scheduler
settings, and each length source scored alone and combined."""

from __future__ import annotations

import numpy as np


def policy_prompts(policy: str, examples) -> list[tuple[int, list[int]]]:
  """(prompt id, token ids) as a run encodes them for `policy`: [BOS] and the
  characters under the character tokenizer (the tiny policy's), else the
  policy's own tokenizer and chat template (`data.tokenizer.Tokenizer`)."""
  from streamrl.data.loader import make_prompts
  from streamrl.data.tokenizer import Tokenizer
  from streamrl.ranker import data as rdata

  if rdata.fingerprint_tokenizer_dir(policy) == rdata.char_tokenizer_fingerprint():
    return make_prompts(examples)
  tokenizer = Tokenizer(policy)
  return [(ex.prompt_id, tokenizer.encode_prompt(ex.prompt)) for ex in examples]


def answer_tokens(policy: str):
  """answer -> its tokens in a trace under the policy's tokenizer (None: the
  character tokenizer's, one per character)."""
  from streamrl.data import tasks
  from streamrl.data.tokenizer import Tokenizer
  from streamrl.ranker import data as rdata

  if rdata.fingerprint_tokenizer_dir(policy) == rdata.char_tokenizer_fingerprint():
    return None
  return tasks.answer_token_counter(Tokenizer(policy).encode_text)


class Arms:
  """The engines and the arms' runs (bench_skew's module docstring); every
  run samples with `seed`."""

  def __init__(self, gens, sampling, prompts, seed: int):
    from streamrl.scheduling.request import Request

    self.gens, self.sampling, self.seed = gens, sampling, seed
    self.requests = [Request(k, ids) for k, ids in prompts]

  def fixed(self, plan):
    from streamrl.generator import lockstep

    return lockstep.run_fixed(
        self.gens,
        [[self.requests[k] for k in a] for a in plan.assignments],
        list(plan.batch_sizes),
        self.sampling,
        seed=self.seed,
    )

  def pooled(
      self,
      plan,
      *,
      migrate: bool,
      estimates=None,
      straggler_tokens=0,
      straggler=None,
      long_share=4,
      long_instances=None,
  ):
    from streamrl.generator import lockstep, pooled
    from streamrl.scheduling import pool as pool_lib

    n = len(self.gens)
    pool = pool_lib.from_parts(
        [[self.requests[k] for k in a] for a in plan.assignments],
        list(range(n)),
        n_long=plan.n_long_instances,
        estimates=estimates,
    )
    rnd = pooled.PooledRound(
        pool,
        dict(enumerate(plan.batch_sizes)),
        max_tokens=self.sampling.max_tokens,
        migrate=migrate,
        straggler_tokens=straggler_tokens,
        straggler=straggler,
        long_instances=long_instances or tuple(pool.long_instances) or (n - 1,),
        long_share=long_share,
    )
    return lockstep.run_pooled(self.gens, rnd, self.sampling, seed=self.seed)


def run_config_scheduler():
  """configs/ppo.py's scheduler settings (`scheduler.*`)."""
  from streamrl import config as config_lib
  from streamrl.scheduling.config import Scheduler

  cfg = config_lib.load_config("configs/ppo.py")
  return Scheduler(
      **{k: cfg.scheduler[k] for k in Scheduler.__dataclass_fields__ if k in cfg.scheduler}
  )


def source_scores(pred, ranker_tokens, history, groups, true_len, finish_order) -> dict:
  """Each length source alone and combined (streamrl/scheduling/lengths.py),
  as the scheduler scores them: `pred` the ranker's scores, `ranker_tokens`
  those read as lengths, `history[g]` prompt g's lengths in an earlier epoch,
  request r of prompt `groups[r]`, siblings in `finish_order` (request ids in
  the order a run finished them)."""
  from streamrl.scheduling import lengths as lengths_lib

  sibs = dict(
      zip(
          finish_order,
          lengths_lib.sibling_estimates(
              [groups[r] for r in finish_order], [true_len[r] for r in finish_order]
          ),
      )
  )
  return lengths_lib.source_metrics(
      {
          "ranker": list(pred),
          "history": [float(np.mean(history[g])) for g in groups],
          "siblings": [float(np.mean(sibs[r])) if sibs[r] else None for r in range(len(groups))],
          "combined": [
              lengths_lib.combine(ranker_tokens[r], history[g], sibs[r])
              for r, g in enumerate(groups)
          ],
      },
      true_len,
  )
