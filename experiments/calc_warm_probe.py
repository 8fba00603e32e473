"""Offline: warm-up the tiny policy on the calc task; accuracy with a simulated calculator."""
import sys, time, dataclasses, re
import numpy as np, jax, jax.numpy as jnp
from flax import nnx
from streamrl.data import calc as calc_lib, tasks
from streamrl.data import tokenizer as tok
from streamrl.models import config as mc
from streamrl.models.transformer import Transformer
from streamrl.trainer import sft, warmstart
from streamrl.trainer.config import Warmstart

args = dict(a.split("=") for a in sys.argv[1:])
steps = int(args.get("steps", 400)); frac = float(args.get("frac", 0.25)); digits = int(args.get("digits", 4))
lr = float(args.get("lr", 3e-3)); bs = int(args.get("bs", 64)); mean_extra = float(args.get("extra", 1.0))
fmt = args.get("fmt", "pair")
cfg = calc_lib.CalcConfig(digits=digits, tool_fraction=frac, mean_extra_terms=mean_extra)
train = calc_lib.make_examples(20000, 0, cfg)
evals = calc_lib.make_examples(64, 10000, cfg, first_id=10**6)
first = int(args.get("first", 0))
cfg = dataclasses.replace(cfg, tool_steps=first)
policy = Transformer(mc.tiny_qwen2(64), rngs=nnx.Rngs(0))
t0 = time.time()
warm = Warmstart(steps=first + steps, batch_size=bs, lr=lr)
lr2 = float(args.get("lr2", lr))
for k, (n_steps, pairs) in enumerate(warmstart.warmup_phases(warm, train, seed=0, calc=cfg)):
  seq_len = max(len(p) + len(a) for p, a, *_ in pairs)
  policy, loss = sft.warm_start(policy, pairs, steps=n_steps, batch_size=bs, lr=lr if k == 0 and first else lr2, seq_len=seq_len + 1, log_every=max(n_steps // 4, 1))
print(f"warm {steps} steps {time.time()-t0:.0f}s loss {loss:.3f}", flush=True)
graphdef, params = nnx.split(policy)

@jax.jit
def logits_at(params, toks, pos):
  lg = nnx.merge(graphdef, params)(toks)
  return lg[jnp.arange(toks.shape[0]), pos]

def run(prefix: str, temp: float, seed=1):
  L = 288
  B = len(evals)
  toks = np.zeros((B, L), np.int32); n = np.zeros(B, int); done = np.zeros(B, bool); turn_start = np.zeros(B, int)
  for i, e in enumerate(evals):
    ids = [tok.BOS_ID] + tok.encode(e.prompt + prefix); toks[i, :len(ids)] = ids; n[i] = len(ids); turn_start[i] = len(ids) - len(prefix)
  key = jax.random.PRNGKey(seed)
  while not done.all():
    lg = np.asarray(logits_at(params, jnp.asarray(toks), jnp.asarray(np.maximum(n - 1, 0))))
    if temp == 0: nxt = lg.argmax(-1)
    else:
      key, sub = jax.random.split(key); nxt = np.asarray(jax.random.categorical(sub, jnp.asarray(lg / temp)))
    for i in range(B):
      if done[i]: continue
      toks[i, n[i]] = nxt[i]; n[i] += 1
      if nxt[i] == tok.EOS_ID or n[i] >= L - 16: done[i] = True; continue
      if tok.decode([int(nxt[i])]) == "]":
        text = tok.decode(toks[i, turn_start[i]:n[i]].tolist())
        m = re.search(r"\[calc ([^\[\]]*)\]$", text)
        from streamrl.envs import tools as T
        try:
          obs = f"({T.step_calculator(m.group(1))})"
        except Exception: obs = "(error)"
        ids = tok.encode(obs)[: L - 1 - n[i]]; toks[i, n[i]:n[i]+len(ids)] = ids; n[i] += len(ids); turn_start[i] = n[i]
        done[i] = n[i] >= L - 16
  right, tool = 0, 0
  for i, e in enumerate(evals):
    text = tok.decode(toks[i, :n[i]].tolist())
    ans = tasks.final_answer(text.split("=", 1)[1].replace("<eos>", ""))
    right += ans == e.answer; tool += "[calc" in text
    if i < 3: print("   ", text[:160])
  return right / B, tool / B

t0 = time.time()
for temp in (1.0,):
  acc, tool = run("", temp); print(f"natural T={temp}: acc {acc:.3f} tool_use {tool:.2f}")
acc, tool = run("[calc ", 0.0); print(f"forced tool greedy: acc {acc:.3f}  eval {time.time()-t0:.0f}s")
