#!/usr/bin/env python3
"""PyTorch + PEFT twin of `benches/src/bin/distill_step.rs`: bench-155m student (LoRA r16
alpha32 dropout 0 on q,k,v,o,gate,up,down) and a bench-155m teacher (its own random init),
batch 4 x seq 256 random ids. Per step, as a strong PyTorch user writes ROLL's loop:

  with torch.no_grad(): t_vals, t_idx = log_softmax(teacher(ids).logits).topk(64)
  logits = student(ids).logits                          # [B, S, V]
  ce = cross_entropy(logits[:, :-1], ids[:, 1:])        # shifted, mean over tokens
  s_k = log_softmax(logits[:, :-1].gather(-1, t_idx[:, :-1]))   # renormalised on the top-64
  p_k = softmax(t_vals[:, :-1]); kd = (p_k * (log p_k - s_k)).sum(-1).mean()
  (0.5 * ce + 0.5 * kd).backward(); clip 1.0; AdamW lr 2e-4 wd 0.01 eps 1e-8

2 warm-up + 6 timed steps; prints the median step, tokens/s and peak RSS.

Usage: OMP_WAIT_POLICY=PASSIVE python benches/distill_step_pytorch.py [--threads 2]
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM

from bench_model import bench_config

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=4)
p.add_argument("--seq", type=int, default=256)
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--threads", type=int, default=2)
args = p.parse_args()
torch.set_num_threads(args.threads)
config = bench_config()
torch.manual_seed(1)
teacher = LlamaForCausalLM(config).eval()
torch.manual_seed(0)
student = get_peft_model(LlamaForCausalLM(config), LoraConfig(
    r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
))
student.train()
params = [p for p in student.parameters() if p.requires_grad]
opt = torch.optim.AdamW(params, lr=2e-4, weight_decay=0.01, eps=1e-8)
ids = torch.randint(0, config.vocab_size, (args.batch, args.seq))
times, phases = [], ([], [], [])
for i in range(args.warmup + args.steps):
    t = time.perf_counter()
    with torch.no_grad():
        t_vals, t_idx = F.log_softmax(teacher(input_ids=ids).logits, dim=-1).topk(64, dim=-1)
    t_teacher = time.perf_counter() - t
    logits = student(input_ids=ids).logits
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, config.vocab_size), ids[:, 1:].reshape(-1))
    s_k = F.log_softmax(logits[:, :-1].gather(-1, t_idx[:, :-1]), dim=-1)
    t_k = F.log_softmax(t_vals[:, :-1], dim=-1)
    kd = (t_k.exp() * (t_k - s_k)).sum(-1).mean()
    loss = 0.5 * ce + 0.5 * kd
    loss.backward()
    t_student = time.perf_counter() - t
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if i >= args.warmup:
        total = time.perf_counter() - t
        times.append(total)
        phases[0].append(t_teacher)
        phases[1].append(t_student - t_teacher)
        phases[2].append(total - t_student)
median = statistics.median(times)
tt, st, to = (statistics.median(p) for p in phases)
with open("/proc/self/status") as f:
    hwm = next(int(l.split()[1]) for l in f if l.startswith("VmHWM")) * 1024
print(f"pytorch: median step {median:.3f} s, {args.batch * args.seq / median:.1f} tokens/s, "
      f"peak RSS {hwm / 1e9:.2f} GB, loss {loss.item():.4f} (torch {torch.__version__})")
print(f"pytorch: teacher {tt:.3f} s, student forward + backward {st:.3f} s, optimizer {to:.3f} s (medians)")
