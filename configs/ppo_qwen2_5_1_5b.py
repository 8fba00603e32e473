r"""PPO on Qwen2.5-1.5B with a GSM8K/MATH-style JSONL dataset, one 8-GPU node.

The small GPU recipe: the same run as configs/ppo_qwen2_5_7b.py at a size
that iterates quickly. Needs a local HF checkpoint and a JSONL file of
{"prompt": ..., "answer": ...} rows (nothing is downloaded):

  STREAMRL_REQUIREMENTS=requirements-gpu.txt bash install.sh
  python launch/main.py --config=configs/ppo_qwen2_5_1_5b.py --workdir=workdirs/qwen1_5b \
      --config.model.path=/models/Qwen2.5-1.5B-Instruct \
      --config.task.train_path=/data/gsm8k_train.jsonl --config.task.eval_path=/data/gsm8k_test.jsonl

The 8 GPUs, disaggregated (async): 6 generate, 2 train.
- Generation: 6 vLLM instances x 1 GPU (bf16, CUDA graphs). Long reasoning
  outputs make generation the slower stage, so it gets three quarters of
  the node, more than the paper's 62.5 % for 32B (40:24 of 64 GPUs),
  because a 1.5B model trains cheaply.
- Training: 1 trainer process on 2 GPUs, mesh fsdp=2 (fp32 master weights
  and Adam state ~25 GB, bf16 compute with remat "minimal").
For one GPU instead, use the colocated baseline:
  --config=configs/colocated.py:ppo_qwen2_5_1_5b --config.cluster.trainer_gpus=0 \
  --config.engine.num_instances=1 --config.engine.gpu_memory_utilization=0.4
(tests/test_configs.py checks that every GPU config adds up to its NUM_GPUS.)
"""

import os

import ml_collections

from streamrl import config as config_lib

NUM_GPUS = 8  # the GPUs this config claims: trainer + generators


def get_config() -> ml_collections.ConfigDict:
  c = config_lib.load_config(os.path.join(os.path.dirname(__file__), "ppo.py"))
  c.model.path = "/models/Qwen2.5-1.5B-Instruct"
  c.model.dtype = "bfloat16"
  c.warmstart.steps = 0
  c.task.kind = "file"
  c.task.train_path = "/data/gsm8k_train.jsonl"
  c.task.eval_path = "/data/gsm8k_test.jsonl"
  c.task.prompt_key = "question"  # raw GSM8K rows: {"question", "answer"}
  # Rendered with the Instruct model's chat template (task.chat_template=auto).
  c.task.system_prompt = "Please reason step by step, and put your final answer within \\boxed{}."
  c.task.reward = "math_verify"
  c.task.num_eval = 500
  c.sampling.max_tokens = 2048
  c.engine.max_model_len = 3072
  c.engine.max_num_seqs = 256
  c.engine.num_instances = 6
  c.engine.gpus_per_instance = 1
  c.engine.tensor_parallel_size = 1
  c.engine.gpu_memory_utilization = 0.9
  c.kl.coef = 0.001
  c.trainer.num_iterations = 200
  c.trainer.prompts_per_iteration = 128
  c.trainer.mini_batch_size = 64
  c.trainer.micro_batch_size = 16  # 8 sequences per fsdp shard, 4 accumulation steps
  c.optimizer.lr = 1e-6
  c.optimizer.critic_lr = 1e-5
  c.mesh = dict(data=1, fsdp=2, tensor=1)
  # Keep q/k/v, the attention output and the MLP product; recompute the rest (the
  # memory plan: "dots" at 8 rows x 3072 tokens per GPU does not fit 80 GB).
  c.trainer.remat = "minimal"
  c.cluster.trainer_gpus = 2
  c.cluster.trainer_cpus = 8
  c.cluster.generator_cpus = 24
  c.pipeline.mode = "async"
  # FIFO dispatch and weights through Ray's object store, as this recipe was
  # checked; the ranker (scheduler.kind=skew) and the transfer service
  # (transfer.enabled=True) of configs/ppo.py are one override each.
  c.scheduler.kind = "fifo"
  c.transfer.enabled = False
  c.checkpoint.every = 20
  c.log.eval_every = 20
  return c
