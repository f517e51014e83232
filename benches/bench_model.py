"""The bench model of docs/src/benchmarks.md ("bench-155m"), shared by the PyTorch scripts:
vocab 128256, hidden 512, 8 layers, 8 heads, 4 KV heads, intermediate 1408, theta 500000,
max position 2048, untied embeddings, eps 1e-5; and the seed's Llama-3.2-1B shape ("seed-1b",
fixtures/configs/llama-3.2-1b-instruct.json)."""
import json
import os

from transformers import LlamaConfig


def bench_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128256, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, rope_theta=500000.0,
        max_position_embeddings=2048, tie_word_embeddings=False, rms_norm_eps=1e-5,
    )


def seed_1b_config() -> LlamaConfig:
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "..", "fixtures", "configs", "llama-3.2-1b-instruct.json")) as f:
        raw = json.load(f)
    raw.pop("torch_dtype", None)
    config = LlamaConfig(**raw)
    config._attn_implementation = "sdpa"
    return config
