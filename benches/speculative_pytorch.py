#!/usr/bin/env python3
"""transformers side of the speculative-decoding benchmark (benches/src/bin/speculative.rs,
which writes the weights and passes the prompts): plain greedy `generate` of the target and
assisted generation (`generate(assistant_model=draft)`, transformers' speculative decoding)
with a constant k drafted tokens per verification, batch 1, one prompt at a time; prints
generated tokens/s (median of --repeats after one warm-up) and whether the assisted output
equals the plain one.

Usage (normally run by the Rust bench):
  OMP_WAIT_POLICY=PASSIVE python benches/speculative_pytorch.py --target DIR --draft DIR \
      --prompts "1,2,3;4,5,6" [--k 4] [--new-tokens 64] [--threads 2]
"""
import argparse
import statistics
import time

import torch
import transformers
from transformers import LlamaForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--target", required=True)
p.add_argument("--draft", required=True)
p.add_argument("--prompts", required=True, help="token ids, comma-separated, prompts separated by ;")
p.add_argument("--k", type=int, default=4)
p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
p.add_argument("--new-tokens", type=int, default=64)
p.add_argument("--repeats", type=int, default=3)
p.add_argument("--threads", type=int, default=2)
args = p.parse_args()
torch.set_num_threads(args.threads)
prompts = [torch.tensor([[int(t) for t in row.split(",")]]) for row in args.prompts.split(";")]
target = LlamaForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
draft = LlamaForCausalLM.from_pretrained(args.draft, dtype=torch.float32).eval()
# A fixed number of drafted tokens per verification, as ours (transformers' default adapts it).
draft.generation_config.num_assistant_tokens = args.k
draft.generation_config.num_assistant_tokens_schedule = "constant"
draft.generation_config.assistant_confidence_threshold = 0.0
kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, pad_token_id=0,
          eos_token_id=None)
if args.temperature > 0:
    # The full distribution at the temperature, as ours (transformers' default top_k is 50).
    kw.update(do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0)
else:
    kw.update(do_sample=False)


def run(assisted):
    out = []
    t = time.perf_counter()
    for ids in prompts:
        extra = dict(assistant_model=draft) if assisted else {}
        g = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw, **extra)
        out.append(g[0, ids.shape[1]:].tolist())
    return time.perf_counter() - t, out


torch.manual_seed(0)
with torch.no_grad():
    run(False)
    run(True)
    tp, ta = [], []
    same = True
    for _ in range(args.repeats):
        t, plain = run(False)
        tp.append(t)
        t, assisted = run(True)
        ta.append(t)
        same &= plain == assisted
tokens = len(prompts) * args.new_tokens
mp, ma = statistics.median(tp), statistics.median(ta)
print(f"hf:      target alone {tokens / mp:.1f} tokens/s (transformers {transformers.__version__}, torch {torch.__version__})")
check = f"; output equals plain greedy: {same}" if args.temperature == 0 else ""
print(f"hf:      assisted generation {tokens / ma:.1f} tokens/s = {mp / ma:.2f}x the target alone{check}")
