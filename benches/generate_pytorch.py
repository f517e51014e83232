#!/usr/bin/env python3
"""transformers side of the generation benchmark (reference/benchmarks.md): bench-155m,
random init, batch 8 prompts x 32 random tokens, 64 new tokens, greedy, KV cache; prints
generated tokens/s (median of --repeats after one warm-up).

Usage: OMP_WAIT_POLICY=PASSIVE python benches/generate_pytorch.py [--threads 2]
"""
import argparse
import statistics
import time

import torch
from transformers import LlamaForCausalLM

from bench_model import bench_config

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=8)
p.add_argument("--prompt-len", type=int, default=32)
p.add_argument("--new-tokens", type=int, default=64)
p.add_argument("--repeats", type=int, default=3)
p.add_argument("--threads", type=int, default=2)
args = p.parse_args()
torch.set_num_threads(args.threads)
torch.manual_seed(0)
config = bench_config()
model = LlamaForCausalLM(config).eval()
ids = torch.randint(0, config.vocab_size, (args.batch, args.prompt_len))
mask = torch.ones_like(ids)
kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
          pad_token_id=0, eos_token_id=None)
with torch.no_grad():
    model.generate(input_ids=ids, attention_mask=mask, **kw)
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, **kw)
        times.append(time.perf_counter() - t)
m = statistics.median(times)
print(f"hf:      {m:.3f} s per run, {args.batch * args.new_tokens / m:.1f} generated tokens/s (torch {torch.__version__})")
