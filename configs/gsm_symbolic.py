r"""GRPO on GSM-style word problems in the formats real jobs use: a worked
example of bringing your own job.

  python launch/main.py --config=configs/gsm_symbolic.py --workdir=workdirs/gsm

- Data: reasoning-gym's `gsm_symbolic` generator (GSM8K templates with new
  numbers, made offline by the package; task.kind=gym). Each row keeps the
  generator's metadata, and the reward is the generator's own scorer on the
  response's final answer (task.reward=reasoning_gym); the accuracy is that
  verifier's.
- Prompts: chat messages rendered with the tokenizer's chat template
  (task.chat_template=auto), led by a system prompt.
- Model: a small Qwen3-shaped policy (q/k norms, no qkv bias) with a real
  32,000-piece SentencePiece tokenizer (mistral-common's, shipped with vLLM).
  Its weights are random, so it does not learn the task: the run shows the
  path end to end — generation, the verifier's rewards and accuracy, GRPO
  updates, checkpoints and the trained policy exported as a Hugging Face
  directory (<workdir>/hf) that transformers and vLLM load.

For a real model, point it at a local checkpoint directory, e.g.
--config.model.path=/models/Qwen3-0.6B (its own tokenizer and chat template
are used) and raise sampling.max_tokens.
"""

import os

import ml_collections

from streamrl import config as config_lib


def get_config() -> ml_collections.ConfigDict:
  c = config_lib.load_config(os.path.join(os.path.dirname(__file__), "grpo.py"))
  c.model.tiny = "qwen3"
  c.model.tokenizer = "sentencepiece"
  c.warmstart.steps = 0  # Random weights: nothing to warm up on this task.
  c.task.kind = "gym"
  c.task.gym_dataset = "gsm_symbolic"
  c.task.gym_size = 256
  c.task.num_eval = 8
  c.task.reward = "reasoning_gym"
  c.task.system_prompt = "Solve the problem step by step. End with: The answer is <number>."
  c.advantage.group_size = 4
  c.trainer.prompts_per_iteration = 4
  c.trainer.mini_batch_size = 16
  c.trainer.micro_batch_size = 8
  c.trainer.num_iterations = 3
  c.log.eval_every = 0
  c.checkpoint.every = 1
  c.sampling.max_tokens = 48
  c.engine.max_model_len = 512
  return c
