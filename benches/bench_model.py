"""The bench model of reference/benchmarks.md ("bench-155m"), shared by the PyTorch scripts:
vocab 128256, hidden 512, 8 layers, 8 heads, 4 KV heads, intermediate 1408, theta 500000,
max position 2048, untied embeddings, eps 1e-5."""
from transformers import LlamaConfig


def bench_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128256, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, rope_theta=500000.0,
        max_position_embeddings=2048, tie_word_embeddings=False, rms_norm_eps=1e-5,
    )
