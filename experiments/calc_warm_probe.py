r"""Offline probe of the agentic task's warm-up (streamrl/data/calc.py).

  python experiments/calc_warm_probe.py [first=500] [steps=250] [frac=0.15] \
      [lr=3e-3] [lr2=3e-3] [bs=64] [digits=4] [extra=1.0]

Warm-starts the tiny policy as `trainer.warmstart` does (`warmup_phases`: `first`
steps of tool trajectories alone, then `steps` of the mixture with `frac` of them;
`lr2` is the second phase's rate), then decodes 64 held-out sums in JAX, answering
each call with the real calculator (`envs.tools.step_calculator`), twice: sampled
at temperature 1 (what RL starts from: accuracy and the share that calls the
tool), and greedy with the trajectory forced to start with a call (can the policy
copy what is left into its calls?). No vLLM, no RL: minutes, to compare warm-ups.

Ends with
  RESULT natural_accuracy=<x> tool_use=<x> forced_tool_accuracy=<x> warmup_s=<x>
"""

import dataclasses
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from streamrl.data import calc as calc_lib
from streamrl.data import tasks
from streamrl.data import tokenizer as tok
from streamrl.envs import tools
from streamrl.models import config as model_config
from streamrl.models.transformer import Transformer
from streamrl.trainer import sft, warmstart
from streamrl.trainer.config import Warmstart

MAX_LEN = 288


def main(argv):
  args = dict(a.split("=", 1) for a in argv)
  first, steps = int(args.get("first", 500)), int(args.get("steps", 250))
  lr = float(args.get("lr", 3e-3))
  lr2, bs = float(args.get("lr2", lr)), int(args.get("bs", 64))
  cfg = calc_lib.CalcConfig(
      digits=int(args.get("digits", 4)),
      tool_fraction=float(args.get("frac", 0.15)),
      mean_extra_terms=float(args.get("extra", 1.0)),
      tool_steps=first,
  )
  train = calc_lib.make_examples(20000, 0, cfg)
  held_out = calc_lib.make_examples(64, 10000, cfg, first_id=10**6)
  policy = Transformer(model_config.tiny_qwen2(tok.VOCAB_SIZE), rngs=nnx.Rngs(0))
  t0 = time.time()
  phases = warmstart.warmup_phases(
      Warmstart(steps=first + steps, batch_size=bs, lr=lr), train, seed=0, calc=cfg
  )
  for k, (n, pairs) in enumerate(phases):
    seq_len = max(len(p) + len(a) for p, a, *_ in pairs)
    policy, loss = sft.warm_start(
        policy,
        pairs,
        steps=n,
        batch_size=bs,
        lr=lr if (k == 0 and first) else lr2,
        seq_len=seq_len + 1,
        log_every=max(n // 4, 1),
    )
  warm_s = time.time() - t0
  print(f"warm-up {first}+{steps} steps in {warm_s:.0f} s, last loss {loss:.3f}", flush=True)
  graphdef, params = nnx.split(policy)

  @jax.jit
  def next_logits(params, ids, pos):
    logits = nnx.merge(graphdef, params)(ids)
    return logits[jnp.arange(ids.shape[0]), pos]

  def decode(prefix: str, temperature: float):
    n = len(held_out)
    ids, length = np.zeros((n, MAX_LEN), np.int32), np.zeros(n, int)
    turn = np.zeros(n, int)
    done = np.zeros(n, bool)
    for i, e in enumerate(held_out):
      row = [tok.BOS_ID] + tok.encode(e.prompt + prefix)
      ids[i, : len(row)], length[i] = row, len(row)
      turn[i] = len(row) - len(prefix)
    key = jax.random.PRNGKey(1)
    while not done.all():
      logits = next_logits(params, jnp.asarray(ids), jnp.asarray(np.maximum(length - 1, 0)))
      if temperature == 0:
        nxt = np.asarray(logits.argmax(-1))
      else:
        key, sub = jax.random.split(key)
        nxt = np.asarray(jax.random.categorical(sub, logits / temperature))
      for i in np.flatnonzero(~done):
        ids[i, length[i]] = nxt[i]
        length[i] += 1
        if nxt[i] == tok.EOS_ID or length[i] >= MAX_LEN - 16:
          done[i] = True
        elif tok.decode([int(nxt[i])]) == "]":  # a call: the calculator answers it
          call = re.search(
              r"\[calc ([^\[\]]*)\]$", tok.decode(ids[i, turn[i] : length[i]].tolist())
          )
          try:
            obs = f"({tools.step_calculator(call.group(1))})"
          except Exception:  # pylint: disable=broad-except
            obs = "(error)"
          obs_ids = tok.encode(obs)[: MAX_LEN - 1 - length[i]]
          ids[i, length[i] : length[i] + len(obs_ids)] = obs_ids
          length[i] += len(obs_ids)
          turn[i] = length[i]
          done[i] = length[i] >= MAX_LEN - 16
    texts = [tok.decode(ids[i, 1 : length[i]].tolist()) for i in range(len(held_out))]
    for t in texts[:3]:
      print("   ", t[:160])
    right = [
        tasks.final_answer(t.split("=", 1)[1].replace("<eos>", "")) == e.answer
        for t, e in zip(texts, held_out)
    ]
    return float(np.mean(right)), float(np.mean(["[calc" in t for t in texts]))

  acc, use = decode("", 1.0)
  print(f"sampled (T=1): accuracy {acc:.3f}, calls the tool {use:.2f}")
  forced, _ = decode("[calc ", 0.0)
  print(f"greedy, forced to call: accuracy {forced:.3f}")
  print(
      f"RESULT natural_accuracy={acc:.3f} tool_use={use:.2f} forced_tool_accuracy={forced:.3f} "
      f"warmup_s={warm_s:.0f}"
  )


if __name__ == "__main__":
  main(sys.argv[1:])
