"""A small GPT built from the parallel layers (demo, tests, benchmarks)."""
from .gpt import GPT, GPTConfig, gather_dense_state_dict, shard_dense_state_dict

__all__ = ["GPT", "GPTConfig", "shard_dense_state_dict", "gather_dense_state_dict"]
