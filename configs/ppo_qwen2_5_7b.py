r"""PPO on Qwen2.5-7B with a GSM8K/MATH-style JSONL dataset, one 8-GPU node.

Needs a local HF checkpoint directory and a JSONL file of
{"prompt": ..., "answer": ...} rows (nothing is downloaded):

  STREAMRL_REQUIREMENTS=requirements-gpu.txt bash install.sh
  python launch/main.py --config=configs/ppo_qwen2_5_7b.py --workdir=workdirs/qwen7b \
      --config.model.path=/models/Qwen2.5-7B-Instruct \
      --config.task.jsonl_path=/data/gsm8k_train.jsonl

Trainer: fsdp=4 x tensor=2 over 8 devices (bf16 generation, float32 master
weights); generation: 2 vLLM instances. Expected: reward and accuracy curves
rising over the first ~100 iterations, as in the usual GSM8K PPO recipes. It
can't run on a CPU machine; tests/test_configs.py checks it is consistent.
"""

import os

import ml_collections

from streamrl import config_utils

NUM_DEVICES = 8


def get_config() -> ml_collections.ConfigDict:
  c = config_utils.load_config(os.path.join(os.path.dirname(__file__), "ppo.py"))
  c.model.path = "/models/Qwen2.5-7B-Instruct"
  c.model.dtype = "bfloat16"
  c.warmstart.steps = 0
  c.task.kind = "jsonl"
  c.task.jsonl_path = "/data/gsm8k_train.jsonl"
  c.task.reward = "math_verify"
  c.task.num_eval = 500
  c.generation.max_tokens = 1024
  c.generation.max_model_len = 2048
  c.generation.max_num_seqs = 256
  c.generation.kv_cache_gib = 40.0
  c.generation.num_instances = 2
  c.algo.kl_coef = 0.001
  c.trainer.num_iterations = 200
  c.trainer.prompts_per_iteration = 256
  c.trainer.mini_batch_size = 64
  c.trainer.micro_batch_size = 8  # per step: 8 sequences, 2 per fsdp shard... x accumulation 8
  c.trainer.lr = 1e-6
  c.trainer.critic_lr = 1e-5
  c.mesh = dict(data=1, fsdp=4, tensor=2)
  c.pipeline.mode = "async"
  c.checkpoint.every = 20
  c.log.eval_every = 20
  return c
