r"""PPO on Qwen2.5-7B with a GSM8K/MATH-style JSONL dataset, one 8-GPU node.

Needs a local HF checkpoint directory and GSM8K's train and test files as
JSONL (or Parquet) rows of {"question": ..., "answer": ...} (nothing is
downloaded; the reward reads the answer's `#### x` part):

  STREAMRL_REQUIREMENTS=requirements-gpu.txt bash install.sh
  python launch/main.py --config=configs/ppo_qwen2_5_7b.py --workdir=workdirs/qwen7b \
      --config.model.path=/models/Qwen2.5-7B-Instruct \
      --config.task.train_path=/data/gsm8k_train.jsonl --config.task.eval_path=/data/gsm8k_test.jsonl

The 8 GPUs, disaggregated (async): 4 generate, 4 train.
- Generation: 4 vLLM instances x 1 GPU (bf16, CUDA graphs; a 7B model fits
  one 80 GB GPU with room for a large KV cache, and four independent engines
  give the skew-aware dispatcher four queues to balance).
- Training: 1 trainer process on 4 GPUs, mesh fsdp=4: fp32 master weights
  and Adam state (16 bytes/param, ~122 GB for 7.6B) split four ways, bf16
  compute with layer remat. PPO's clipped loss with group-relative (GRPO)
  advantages and no critic: a critic's weights, Adam state and gradients
  next to the actor's do not fit 4 x 80 GB (the memory plan the run prints
  at start, streamrl/trainer/memory_plan.py, refuses that run and names this
  change).
The paper gives generation the larger share (40:24 for 32B on 64 GPUs,
80:48 for 72B on 128); at 8 GPUs the 7B training state needs 4 GPUs, so
the split here is 4:4. Sweep `engine.num_instances` against
`cluster.trainer_gpus` (and the mesh) to rebalance; the totals must stay 8
(tests/test_configs.py checks every GPU config's budget).
"""

import os

import ml_collections

from streamrl import config as config_lib

NUM_GPUS = 8  # the GPUs this config claims: trainer + generators


def get_config() -> ml_collections.ConfigDict:
  c = config_lib.load_config(os.path.join(os.path.dirname(__file__), "ppo.py"))
  c.model.path = "/models/Qwen2.5-7B-Instruct"
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
  c.sampling.max_tokens = 1024
  c.engine.max_model_len = 2048
  c.engine.max_num_seqs = 256
  c.engine.num_instances = 4
  c.engine.gpus_per_instance = 1
  c.engine.tensor_parallel_size = 1
  c.engine.gpu_memory_utilization = 0.9
  c.kl.coef = 0.001
  c.advantage.estimator = "grpo"
  c.advantage.use_critic = False
  c.advantage.group_size = 4
  c.trainer.num_iterations = 200
  c.trainer.prompts_per_iteration = 64  # x 4 samples
  c.trainer.mini_batch_size = 64
  c.trainer.micro_batch_size = 8  # 2 sequences per fsdp shard, 8 accumulation steps
  c.optimizer.lr = 1e-6
  c.mesh = dict(data=1, fsdp=4, tensor=1)
  c.trainer.remat = "dots"  # keep the projections, recompute attention scores
  c.cluster.trainer_gpus = 4
  c.cluster.trainer_cpus = 16
  c.cluster.generator_cpus = 16
  c.pipeline.mode = "async"
  # FIFO dispatch and weights through Ray's object store, as this recipe was
  # checked; the ranker (scheduler.kind=skew) and the transfer service
  # (transfer.enabled=True) of configs/ppo.py are one override each.
  c.scheduler.kind = "fifo"
  c.transfer.enabled = False
  c.checkpoint.every = 20
  c.log.eval_every = 20
  return c
