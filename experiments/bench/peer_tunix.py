r"""The Tunix arm of experiments/bench/bench_peers.py: Google's JAX RL library on the same GRPO job.

Tunix (`google-tunix`) pins `safetensors<0.8` and our `transformers` needs
`safetensors>=0.8`, so it cannot share StreamRL's environment; it runs in a
virtualenv of its own, which `ensure_venv` creates on first use (StreamRL
installed editable, Tunix, and the few pins that differ from constraints.txt,
`TUNIX_PINS`). By hand: a new virtualenv, constraints.txt with the
`TUNIX_PINS` lines in place of ours, then `pip install -c <that file> -e .
google-tunix==<TUNIX's version>`, and `--tunix_python=<venv>/bin/python`.

`run_child` is the run itself, in that venv's interpreter: the warm-started
policy loaded through Tunix's Qwen2 model (`create_model_from_safe_tensors`),
Tunix's `GRPOLearner` with its vanilla sampler colocated on the CPU device,
prompts drawn by StreamRL's own `PromptLoader` (the order StreamRL draws them
in), the task's verifier as the reward, StreamRL's optimizer
(`streamrl.trainer.step.make_optimizer`: the same warm-up, cosine decay,
AdamW and clipping). The policy is snapshotted at every evaluation point
(host copies, their time taken off the clock) and written afterwards as
Hugging Face directories, which the parent evaluates with StreamRL's held-out
evaluation like TRL's checkpoints.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

TUNIX = "google-tunix==0.1.7"
# Where Tunix's environment differs from constraints.txt (pip's resolution
# of Tunix's `safetensors<0.8` against the rest of our pins).
TUNIX_PINS = {
    "safetensors": "0.7.0",
    "transformers": "5.12.1",
    "tokenizers": "0.22.2",
    "huggingface-hub": "1.33.0",
}


def tunix(module: str):
  """`tunix.<module>`, imported by name: Tunix lives only in its own venv and is
  deliberately no dependency of this package (pyproject.toml's `peers` note)."""
  import importlib

  return importlib.import_module(f"tunix.{module}")


# What the bench cannot set the same way in Tunix, printed with the results.
UNMATCHED = (
    "generation per mini-batch: Tunix generates 16 prompts x 4 samples, trains "
    "its 2 epochs on them, then generates the next 16 with the updated policy "
    "(StreamRL generates 32 x 4 one weight version ahead, asynchronously)",
    "lengths: Tunix pads every completion to the response cap for its log-prob and "
    "training passes (its sampler stops when the whole batch has ended; StreamRL buckets "
    "lengths per micro-batch)",
    "sampling seed: Tunix's RolloutConfig.seed defaults to one fixed key for every "
    "batch; the bench sets a new seed per generation (seed x 1000 + batch)",
    "advantages: Tunix's grpo estimator (group mean and std, its own epsilon)",
)


def python_has_tunix(python: str) -> bool:
  if not os.path.exists(python):
    return False
  rc = subprocess.run([python, "-c", "import tunix, streamrl"], capture_output=True).returncode
  return rc == 0


def ensure_venv(venv: str) -> str:
  """The interpreter of `venv`, created with StreamRL and Tunix when it has no Tunix yet."""
  python = os.path.join(venv, "bin", "python")
  if python_has_tunix(python):
    return python
  print(f"creating Tunix's virtualenv in {venv} (a few minutes, once)", flush=True)
  subprocess.run([sys.executable, "-m", "venv", venv], check=True)
  with open(os.path.join(ROOT, "constraints.txt")) as f:
    pins = [l for l in f if l.split("==")[0].strip().lower() not in TUNIX_PINS]
  constraints = os.path.join(venv, "constraints.txt")
  with open(constraints, "w") as f:
    f.writelines(pins + [f"{k}=={v}\n" for k, v in TUNIX_PINS.items()])
  pip = [python, "-m", "pip", "install", "-q", "-c", constraints, "-e", ROOT, TUNIX]
  subprocess.run(pip, check=True)
  return python


# ------------------------------------------------------ in Tunix's venv
def tunix_config(model_dir: str):
  """Tunix's Qwen2 ModelConfig for a Hugging Face Qwen2 directory."""
  qwen2 = tunix("models.qwen2.model")

  with open(os.path.join(model_dir, "config.json")) as f:
    hf = json.load(f)
  if hf.get("model_type") != "qwen2":
    raise ValueError(f"the Tunix arm loads Qwen2 policies; {model_dir} is {hf.get('model_type')}")
  return qwen2.ModelConfig(
      num_layers=hf["num_hidden_layers"],
      vocab_size=hf["vocab_size"],
      embed_dim=hf["hidden_size"],
      hidden_dim=hf["intermediate_size"],
      num_heads=hf["num_attention_heads"],
      head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
      num_kv_heads=hf["num_key_value_heads"],
      rope_theta=int(hf["rope_theta"]),
      norm_eps=hf["rms_norm_eps"],
      use_tied_embedding=bool(hf.get("tie_word_embeddings", False)),
  )


def flat_params(model) -> dict:
  """{'layers.0.attn.q_proj.w': np.ndarray, ...}: host copies of the model's parameters."""
  import jax
  from flax import nnx

  out = {}
  for path, leaf in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    value = leaf.get_value() if hasattr(leaf, "get_value") else getattr(leaf, "value", leaf)
    out[".".join(str(p) for p in path)] = value
  return jax.device_get(out)


def export_hf(params: dict, cfg, model_dir: str, out_dir: str) -> None:
  """Writes `params` (flat_params of Tunix's Qwen2) as a Hugging Face directory
  shaped like `model_dir`: Tunix's own loading table read backwards (each
  tensor reshaped to the transposed 2-D form, transposed back, or reshaped
  alone), tokenizer and config copied."""
  import numpy as np
  from safetensors import numpy as st

  qwen2_params = tunix("models.qwen2.params")
  table = qwen2_params._get_key_and_transform_mapping(cfg)  # pylint: disable=protected-access
  original = {}
  for name in sorted(os.listdir(model_dir)):
    if name.endswith(".safetensors"):
      original.update(st.load_file(os.path.join(model_dir, name)))
  tensors = {}
  for hf_key, ref in original.items():
    for pattern, (tunix_key, transform) in table.items():
      if re.fullmatch(pattern, hf_key):
        value = np.asarray(params[re.sub(pattern, tunix_key, hf_key)])
        if transform is not None and transform[0] is not None:
          value = value.reshape(ref.shape[::-1]).T
        tensors[hf_key] = np.ascontiguousarray(value.reshape(ref.shape).astype(ref.dtype))
        break
    else:
      raise ValueError(f"no Tunix parameter for {hf_key}")
  os.makedirs(out_dir, exist_ok=True)
  for name in os.listdir(model_dir):
    path = os.path.join(model_dir, name)
    if os.path.isfile(path) and not name.endswith(".safetensors"):
      shutil.copy(path, out_dir)
  st.save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def same_weights(dir_a: str, dir_b: str) -> bool:
  import numpy as np
  from safetensors import numpy as st

  a = st.load_file(os.path.join(dir_a, "model.safetensors"))
  b = st.load_file(os.path.join(dir_b, "model.safetensors"))
  return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def run_child(args: dict) -> None:
  """The Tunix run (in Tunix's venv): trains, snapshots, exports, writes times.json."""
  import jax
  import numpy as np
  import transformers

  from experiments.bench import bench_peers
  from streamrl.trainer import setup
  from streamrl.data import verifiers as rewards_lib
  from streamrl.data.loader import PromptLoader
  from streamrl.trainer.step import make_optimizer

  qwen2_params = tunix("models.qwen2.params")
  rl_cluster_lib = tunix("rl.rl_cluster")
  grpo_learner = tunix("rl.grpo.grpo_learner")
  base_rollout = tunix("rl.rollout.base_rollout")

  s = bench_peers.settings_for(
      args["seed"], args["iterations"], args["num_eval"], args["eval_every"]
  )
  model_dir, out_dir = args["model_dir"], args["out_dir"]
  train_examples, _ = setup.load_examples(s)
  tok = setup.make_tokenizer(s, model_dir)
  hf_tok = transformers.AutoTokenizer.from_pretrained(model_dir)
  loader = PromptLoader(train_examples, bench_peers.PROMPTS, seed=s.seed)
  batches = [next(loader) for _ in range(s.trainer.num_iterations)]
  prompt_ids = {ex.prompt: list(tok.encode_prompt(ex.prompt)) for b in batches for ex in b}
  texts = {p: bench_peers.peer_prompt(hf_tok, ids) for p, ids in prompt_ids.items()}

  cfg = tunix_config(model_dir)
  # Auto axes: Tunix's Qwen2 indexes its sharded embedding without an out-sharding.
  auto = (jax.sharding.AxisType.Auto,) * 2
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=auto)
  policy = qwen2_params.create_model_from_safe_tensors(model_dir, cfg, mesh)
  reference = qwen2_params.create_model_from_safe_tensors(model_dir, cfg, mesh)
  max_prompt = max(len(ids) for ids in prompt_ids.values())
  group, mini_prompts = bench_peers.GROUP, bench_peers.MINI // bench_peers.GROUP
  rollout_config = base_rollout.RolloutConfig(
      max_tokens_to_generate=s.sampling.max_tokens,
      max_prompt_length=max_prompt,
      kv_cache_size=max_prompt + s.sampling.max_tokens + 8,
      temperature=s.sampling.temperature,
      top_p=s.sampling.top_p,
      top_k=None,
      eos_tokens=[hf_tok.eos_token_id],
      seed=s.seed * 1000,
  )
  steps = s.optimizer_steps
  cluster = rl_cluster_lib.RLCluster(
      actor=policy,
      reference=reference,
      tokenizer=hf_tok,
      cluster_config=rl_cluster_lib.ClusterConfig(
          role_to_mesh={r: mesh for r in rl_cluster_lib.Role},
          rollout_engine="vanilla",
          offload_to_cpu=False,
          training_config=rl_cluster_lib.RLTrainingConfig(
              actor_optimizer=make_optimizer(s.optimizer, lr=s.optimizer.lr, decay_steps=steps),
              eval_every_n_steps=10 * steps,
              max_steps=steps,
              mini_batch_size=mini_prompts,
              train_micro_batch_size=mini_prompts,
              rollout_micro_batch_size=mini_prompts,
              compute_logps_micro_batch_size=mini_prompts,
          ),
          rollout_config=rollout_config,
      ),
  )
  algo = grpo_learner.GRPOConfig(
      num_generations=group,
      num_iterations=bench_peers.EPOCHS,
      beta=s.kl.coef,
      kl_loss_mode="low_var_kl",  # k3: (r - 1) - log r
      epsilon=s.loss.clip_low,
      loss_agg_mode="token-mean",
  )
  if s.loss.clip_high != s.loss.clip_low:
    raise ValueError("Tunix's GRPOConfig clips symmetrically; the job clips asymmetrically.")

  # Tunix's sampler tokenizes the prompt text itself; it must give StreamRL's ids.
  sampler = cluster.rollout._sampler  # pylint: disable=protected-access
  for p, ids in prompt_ids.items():
    if list(sampler.tokenize(texts[p])) != ids:
      raise RuntimeError(f"Tunix would tokenize {p!r} differently from StreamRL.")

  answer_of = setup.answer_of(s)
  score = getattr(rewards_lib, s.task.reward)
  every = args["eval_every"]
  per_it = bench_peers.PROMPTS // mini_prompts  # generations per iteration
  log = {"calls": [], "snap_s": 0.0, "snaps": {}, "tokens": 0, "samples": 0}
  known = set(texts.values())
  snaps = {}

  # The reward is called once per generated mini-batch, before Tunix trains
  # on it, so call n sees the policy after n / per_it iterations; its time
  # includes that mini-batch's generation (later than the policy's, by one).
  def reward(prompts, completions, answer, **unused):
    if not len(prompts) == len(completions) == len(answer) == mini_prompts * group:
      raise RuntimeError(f"Tunix passed {len(prompts)} prompts, {len(completions)} completions.")
    if any(p not in known for p in prompts):
      raise RuntimeError("Tunix generated from a prompt the bench did not give it.")
    n = len(log["calls"])
    if n and n % (per_it * every) == 0:  # the policy after n / per_it iterations
      t = time.time()
      snaps[n // per_it] = flat_params(cluster.actor_trainer.model)
      log["snap_s"] += time.time() - t
      log["snaps"][n // per_it] = time.time() - log["begin"] - log["snap_s"]
    log["calls"].append(time.time() - log["begin"] - log["snap_s"])
    log["samples"] += len(completions)
    for c in completions:
      n_tok = len(hf_tok(c, add_special_tokens=False)["input_ids"])
      log["tokens"] += min(n_tok + 1, s.sampling.max_tokens)  # + <eos> unless cut
    rollout_config.seed = s.seed * 1000 + n + 1  # the next generation's seed
    return [float(score(answer_of(c), a)) for c, a in zip(completions, answer)]

  learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=algo, reward_fns=reward)
  # Columns as numpy arrays, as Tunix's own data pipelines give them: it
  # repeats each column with np.repeat over the pytree, which would take a
  # list's strings one by one.
  data = [
      {
          "prompts": np.array([texts[ex.prompt] for ex in b]),
          "answer": np.array([ex.answer for ex in b]),
      }
      for b in batches
  ]
  log["begin"] = time.time()
  learner.train(data)
  log["end"] = time.time()
  snaps[s.trainer.num_iterations] = flat_params(cluster.actor_trainer.model)
  log["snaps"][s.trainer.num_iterations] = log["end"] - log["begin"] - log["snap_s"]
  log["train_s"] = log["end"] - log["begin"] - log["snap_s"]
  log["startup_s"] = log["begin"] - args["t0"]
  log["train_steps"] = int(cluster.actor_trainer.train_steps)

  # The exporter, proved on the warm start: Tunix's loading read backwards
  # must give back the very tensors it loaded.
  check = os.path.join(out_dir, "export_check")
  export_hf(flat_params(reference), cfg, model_dir, check)
  if not same_weights(model_dir, check):
    raise RuntimeError("exporting Tunix's Qwen2 does not give back the loaded weights")
  log["dirs"] = {}
  for it, params in sorted(snaps.items()):
    log["dirs"][it] = os.path.join(out_dir, f"iteration-{it}")
    export_hf(params, cfg, model_dir, log["dirs"][it])
  log["wall_s"] = time.time() - args["t0"]
  with open(os.path.join(out_dir, "times.json"), "w") as f:
    json.dump(log, f)


def run_tunix(s, workdir: str, model_dir: str, python: str, eval_every: int) -> dict:
  """Runs `run_child` in `python` (Tunix's venv); its rates and curve (dirs to evaluate).
  (Called from bench_peers run as __main__: importing it here again would define its flags twice.)
  """
  out_dir = os.path.join(workdir, "tunix")
  os.makedirs(out_dir, exist_ok=True)
  args = dict(
      seed=s.seed,
      iterations=s.trainer.num_iterations,
      num_eval=s.task.num_eval,
      eval_every=eval_every,
      model_dir=model_dir,
      out_dir=out_dir,
      t0=time.time(),
  )
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  with open(os.path.join(workdir, "tunix.log"), "w") as log:
    rc = subprocess.run(
        [python, os.path.abspath(__file__), json.dumps(args)],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    ).returncode
  if rc:
    raise RuntimeError(f"the Tunix run exited {rc}; its log: {workdir}/tunix.log")
  with open(os.path.join(out_dir, "times.json")) as f:
    t = json.load(f)
  curve = [dict(samples=0, train_s=0.0, dir=model_dir)]
  for it, path in sorted(t["dirs"].items(), key=lambda kv: int(kv[0])):
    curve.append(dict(samples=int(it) * s.samples_per_iteration, train_s=t["snaps"][it], dir=path))
  return dict(
      samples_per_s=t["samples"] / t["train_s"],
      tokens_per_s=t["tokens"] / t["train_s"],
      train_s=t["train_s"],
      startup_s=t["startup_s"],
      wall_s=t["wall_s"],
      train_steps=t["train_steps"],
      curve=curve,
  )


if __name__ == "__main__":
  run_child(json.loads(sys.argv[1]))
