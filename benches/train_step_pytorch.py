#!/usr/bin/env python3
"""PyTorch + PEFT side of the LoRA train-step benchmark (docs/src/benchmarks.md): bench-155m
(vocab 128256, hidden 512, 8 layers, 8 heads, 4 KV heads, intermediate 1408, theta 500000,
untied, eps 1e-5), random init, batch 4 x seq 256 random ids (labels = ids), LoRA r16 alpha32
dropout 0 on q,k,v,o,gate,up,down, AdamW lr 2e-4 wd 0.01 eps 1e-8, clip 1.0; 3 warm-up + 10
timed steps; prints the median step, tokens/s and peak RSS.

`--preset seed-1b`: the Llama-3.2-1B configuration (fixtures/configs/llama-3.2-1b-instruct.json,
random weights), LoRA r64 alpha128 dropout 0.05 on the seven projections, SDPA attention,
batch 1 x 2048 (override with --batch/--seq), 1 warm-up + 2 timed steps.

Prints CPU time / wall time over the timed steps (about --threads on an idle machine).

Usage: OMP_WAIT_POLICY=PASSIVE python benches/train_step_pytorch.py [--threads 2] [--preset seed-1b]
"""
import argparse
import statistics
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM

from bench_model import bench_config, seed_1b_config

p = argparse.ArgumentParser()
p.add_argument("--preset", choices=["bench-155m", "seed-1b"], default="bench-155m")
p.add_argument("--batch", type=int, default=None)
p.add_argument("--seq", type=int, default=None)
p.add_argument("--warmup", type=int, default=None)
p.add_argument("--steps", type=int, default=None)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 128256)")
p.add_argument("--device", default="cpu", help="cpu or cuda")
args = p.parse_args()
seed_1b = args.preset == "seed-1b"
defaults = (1, 2048, 1, 2) if seed_1b else (4, 256, 3, 10)
args.batch = args.batch or defaults[0]
args.seq = args.seq or defaults[1]
args.warmup = defaults[2] if args.warmup is None else args.warmup
args.steps = args.steps or defaults[3]
torch.set_num_threads(args.threads)
torch.manual_seed(0)
if seed_1b:
    config = seed_1b_config()
    lora = dict(r=64, lora_alpha=128, lora_dropout=0.05)
else:
    config = bench_config()
    lora = dict(r=16, lora_alpha=32, lora_dropout=0.0)
if args.vocab:
    config.vocab_size = args.vocab
model = LlamaForCausalLM(config).to(args.device)
model = get_peft_model(model, LoraConfig(
    **lora, task_type="CAUSAL_LM",
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
))
model.train()
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4, weight_decay=0.01, eps=1e-8)
ids = torch.randint(0, config.vocab_size, (args.batch, args.seq)).to(args.device)


def sync():
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()

times = []
phases = ([], [], [])
cpu0 = wall0 = None
for i in range(args.warmup + args.steps):
    if i == args.warmup:
        cpu0, wall0 = time.process_time(), time.perf_counter()
    t = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    sync()
    t_forward = time.perf_counter() - t
    loss.backward()
    sync()
    t_backward = time.perf_counter() - t
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if i >= args.warmup:
        sync()
        total = time.perf_counter() - t
        times.append(total)
        phases[0].append(t_forward)
        phases[1].append(t_backward - t_forward)
        phases[2].append(total - t_backward)
median = statistics.median(times)
t_f, t_b, t_o = (statistics.median(p) for p in phases)
with open("/proc/self/status") as f:
    hwm = next(int(l.split()[1]) for l in f if l.startswith("VmHWM")) * 1024
cpu_ratio = (time.process_time() - cpu0) / max(time.perf_counter() - wall0, 1e-9)
print(f"pytorch: median step {median:.3f} s, {args.batch * args.seq / median:.1f} tokens/s, "
      f"peak RSS {hwm / 1e9:.2f} GB, loss {loss.item():.4f}, CPU/wall {cpu_ratio:.2f} "
      f"(torch {torch.__version__}, {args.preset})")
print(f"pytorch: forward {t_f:.3f} s, backward {t_b:.3f} s, optimizer {t_o:.3f} s (medians)")
if args.device.startswith("cuda"):
    print(f"pytorch: device memory: peak in use {torch.cuda.max_memory_allocated() / 1e9:.2f} GB, "
          f"peak reserved {torch.cuda.max_memory_reserved() / 1e9:.2f} GB "
          f"({torch.cuda.get_device_name()})")
