#!/usr/bin/env python3
"""transformers side of the generation benchmark (docs/src/benchmarks.md): bench-155m,
random init, batch 8 prompts x 32 random tokens, 64 new tokens, greedy, KV cache; prints
generated tokens/s (median of --repeats after one warm-up).

Usage: OMP_WAIT_POLICY=PASSIVE python benches/generate_pytorch.py [--threads 2]
"""
import argparse
import statistics
import time

import torch
from transformers import LlamaForCausalLM

from bench_model import bench_config, seed_1b_config

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=8)
p.add_argument("--prompt-len", type=int, default=32)
p.add_argument("--new-tokens", type=int, default=64)
p.add_argument("--repeats", type=int, default=3)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--preset", choices=["bench-155m", "seed-1b"], default="bench-155m")
p.add_argument("--device", default="cpu", help="cpu or cuda")
p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the preset's)")
args = p.parse_args()
torch.set_num_threads(args.threads)
torch.manual_seed(0)
if args.preset == "seed-1b":
    config = seed_1b_config()
else:
    config = bench_config()
if args.vocab:
    config.vocab_size = args.vocab
model = LlamaForCausalLM(config).eval().to(args.device)
ids = torch.randint(0, config.vocab_size, (args.batch, args.prompt_len)).to(args.device)
mask = torch.ones_like(ids)
kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
          pad_token_id=0, eos_token_id=None)
with torch.no_grad():
    model.generate(input_ids=ids, attention_mask=mask, **kw)
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, **kw)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
m = statistics.median(times)
print(f"hf:      {m:.3f} s per run, {args.batch * args.new_tokens / m:.1f} generated tokens/s (torch {torch.__version__}, {args.preset}, {args.device})")
