"""Output-length ranker trained offline on (prompt tokens, output length) pairs.

Run:
  python launch/train_ranker.py --config=configs/ranker.py --workdir=/tmp/ranker
  python launch/train_ranker.py --config=configs/ranker.py:tiny --workdir=/tmp/ranker_tiny  # seconds

Other losses: --config.loss=pairwise | both. Real pairs saved by the RL loop:
--config.data.pairs_path=<workdir>/length_pairs.jsonl --config.tokenizer=<policy model dir>.

Expected (synthetic tasks' answer lengths, 1000 held-out prompts; measured at
--config.steps=1000, ~2.5 min on 2 shared cores): recall20 = 1.00,
recall10 = 0.99, recall5 = 1.00, spearman = 0.995 with loss=mse (pairwise: the
same recalls, spearman 0.91; both: spearman 0.995). A random ranker gets recall
≈ the fraction itself and spearman ≈ 0; "longer prompt = longer answer" gets
recall20 = 0.78, spearman = 0.94. `:tiny` (300 steps, ~1 min): recall20 ≈ 0.99.
On real generations of a warmed-up tiny policy (experiments/bench/bench_skew.py)
recall20 = 0.98, recall10 = 0.86-0.88, recall5 = 0.62, spearman = 0.97-0.985
for all three losses. Metrics go to TensorBoard under <workdir>/tb;
checkpoints to <workdir>/checkpoints.
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  # "char" = streamrl.data.tokenizer; otherwise the policy's HF model directory.
  c.tokenizer = "char"
  c.loss = "mse"  # "mse" (log1p-length regression) | "pairwise" (RankNet) | "both"
  c.pair_weight = 1.0  # Weight of the pairwise term when loss="both".

  c.model = ml_collections.ConfigDict()
  c.model.d_model = 64
  c.model.num_layers = 2
  c.model.num_heads = 4
  c.model.mlp_dim = 128
  c.model.max_len = 128  # Longer prompts keep their first max_len tokens.
  c.buckets = (16, 32, 64, 128)

  c.optim = ml_collections.ConfigDict()
  c.optim.lr = 1e-3
  c.optim.warmup_steps = 100
  c.optim.weight_decay = 1e-4
  c.optim.clip = 1.0

  c.batch_size = 64
  c.steps = 2000
  c.log_every = 100
  c.eval_every = 500
  c.checkpoint_every = 1000
  c.max_to_keep = 2
  c.predict_batch = 256

  # Online refresh during RL (RankerTrainer.update).
  c.online = ml_collections.ConfigDict()
  c.online.window = 2048  # Train on the most recent pairs only: lengths drift.
  c.online.steps = 50
  c.online.eval_newest = 512  # Score the newest pairs before training on them.

  c.data = ml_collections.ConfigDict()
  c.data.pairs_path = ml_collections.FieldReference(None, field_type=str)
  c.data.eval_fraction = 0.1  # Only for pairs_path.
  c.data.num_train = 8000
  c.data.num_eval = 1000
  c.data.seed = 0
  c.data.task = ml_collections.ConfigDict()
  c.data.task.max_answer_len = 48
  c.data.task.median_len = 4.0
  c.data.task.sigma = 1.0

  if arg == "tiny":  # Laptop / test variant.
    c.model.d_model = 32
    c.model.num_layers = 1
    c.model.num_heads = 2
    c.model.mlp_dim = 64
    c.model.max_len = 64
    c.buckets = (32, 64)
    c.batch_size = 32
    c.steps = 300
    c.log_every = 50
    c.eval_every = 300
    c.checkpoint_every = 300
    c.predict_batch = 128
    c.data.num_train = 2000
    c.data.num_eval = 400
  elif arg:
    raise ValueError(
        f"unknown config variant {arg!r}; use configs/ranker.py or configs/ranker.py:tiny."
    )
  return c
