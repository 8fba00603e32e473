"""Output-length ranker: a small Flax model that predicts which prompts generate long outputs."""

from streamrl.ranker.data import append_pairs, char_tokenizer_fingerprint, fingerprint_tokenizer_dir, load_pairs
from streamrl.ranker.metrics import ranking_metrics, recall_at_top, spearman

__all__ = [
    "append_pairs",
    "char_tokenizer_fingerprint",
    "fingerprint_tokenizer_dir",
    "load_pairs",
    "ranking_metrics",
    "recall_at_top",
    "spearman",
]
