"""StreamRL: RL post-training for LLMs with disaggregated stream generation."""
