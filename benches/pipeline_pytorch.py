#!/usr/bin/env python3
"""PyTorch + transformers + PEFT side of the speculator-pipeline benchmark
(benches/src/bin/pipeline.rs, which writes the weights and the data file): the same work as
our pipeline, written the way a PyTorch/HF user would.

- setup: the target's tokenizer, the prompts of --data (OpenAI batch JSONL) through the
  model's own chat template (with the generation prompt), the target and the draft loaded in
  f32, LoRA on the draft (PEFT: r16 alpha32 dropout 0 on q,k,v,o,gate,up,down);
- generation: the target completes every prompt, greedy, exactly --new-tokens new tokens (no
  EOS stop), `generate` on --batch-size prompts at a time, longest prompts first (as ours,
  to reduce padding), left padding with an attention mask;
- training: one epoch of the draft's adapters on prompt + completion (labels on the
  completion only), micro-batches of --train-batch-size grouped by length (as ours), an
  optimizer step every --grad-accum of them (the last step may be shorter), loss =
  ce_weight x CE summed over the step's label tokens / their count (global token
  normalisation, as ours), AdamW, cosine schedule with warmup, global-norm clipping; then the
  adapter (+ optimizer and scheduler state, as a Trainer checkpoint) is saved to
  --out/checkpoint-epoch-0.

Prints the wall-clock of each phase, generated tokens/s and trained label tokens/s.

Usage (normally run by the Rust bench):
  OMP_WAIT_POLICY=PASSIVE python benches/pipeline_pytorch.py --target DIR --draft DIR \
      --data FILE --out DIR [--new-tokens 64] [--threads 2]
"""
import argparse
import json
import math
import os
import time

import peft
import torch
import transformers
from peft import LoraConfig, get_peft_model
from transformers import AutoTokenizer, LlamaForCausalLM, get_cosine_schedule_with_warmup

p = argparse.ArgumentParser()
p.add_argument("--target", required=True)
p.add_argument("--draft", required=True)
p.add_argument("--data", required=True, help="OpenAI batch JSONL (custom_id, body.messages)")
p.add_argument("--new-tokens", type=int, default=64)
p.add_argument("--out", required=True)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--batch-size", type=int, default=32, help="prompts per generate call")
p.add_argument("--train-batch-size", type=int, default=4)
p.add_argument("--grad-accum", type=int, default=4)
p.add_argument("--lr", type=float, default=2e-4)
p.add_argument("--warmup-ratio", type=float, default=0.03)
p.add_argument("--weight-decay", type=float, default=0.01)
p.add_argument("--lora-r", type=int, default=16)
p.add_argument("--lora-alpha", type=float, default=32)
p.add_argument("--max-grad-norm", type=float, default=1.0)
p.add_argument("--seed", type=int, default=42)
# Ours: SpeculatorConfig defaults (ce_weight 0.5, group_by_length with buckets of 50 batches,
# max_seq_length 2048).
p.add_argument("--ce-weight", type=float, default=0.5, help="the loss is ce_weight x CE, as ours")
p.add_argument("--bucket-batches", type=int, default=50,
               help="length grouping: shuffled buckets of this many batches, each sorted by "
                    "length (as ours and transformers' LengthGroupedSampler); 0 = plain shuffle")
p.add_argument("--max-seq-length", type=int, default=2048)
args = p.parse_args()
torch.set_num_threads(args.threads)
torch.manual_seed(args.seed)

started = time.perf_counter()

# --- Setup: tokenizer, prompts, models, LoRA. ---
tokenizer = AutoTokenizer.from_pretrained(args.target)
prompts = []
with open(args.data) as f:
    for line in f:
        if not line.strip():
            continue
        messages = json.loads(line)["body"]["messages"]
        enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        # transformers 5 returns a BatchEncoding, older versions a list of ids.
        ids = enc["input_ids"] if hasattr(enc, "keys") else enc
        prompts.append(list(ids))
target = LlamaForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
draft = LlamaForCausalLM.from_pretrained(args.draft, dtype=torch.float32)
model = get_peft_model(draft, LoraConfig(
    r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
))
setup_s = time.perf_counter() - started

# --- Generation: batched greedy generate, longest prompts first, left padding. ---
PAD = 0
t = time.perf_counter()
order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]), reverse=True)
completions = [None] * len(prompts)
gen_kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
              eos_token_id=None, pad_token_id=PAD)
with torch.inference_mode():
    for start in range(0, len(order), args.batch_size):
        chunk = order[start:start + args.batch_size]
        width = max(len(prompts[i]) for i in chunk)
        ids = torch.full((len(chunk), width), PAD, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, i in enumerate(chunk):
            n = len(prompts[i])
            ids[r, width - n:] = torch.tensor(prompts[i])
            mask[r, width - n:] = 1
        out = target.generate(input_ids=ids, attention_mask=mask, **gen_kw)
        for r, row in enumerate(out[:, width:].tolist()):
            completions[chunk[r]] = row
gen_s = time.perf_counter() - t
generated = sum(len(c) for c in completions)

# --- Examples: prompt + completion, labels -100 on the prompt (ours' truncation rule). ---
examples = []
for prompt, completion in zip(prompts, completions):
    if not completion:
        continue
    P, C, L = len(prompt), len(completion), args.max_seq_length
    keep_p = P if P + C <= L else min(P, max(L - C, L // 2))
    keep_c = min(C, L - keep_p)
    prompt, completion = prompt[P - keep_p:], completion[:keep_c]
    examples.append((prompt + completion, [-100] * len(prompt) + completion))
del target

# Micro-batches: shuffled with the seed, grouped by length in buckets (as ours), the batch
# order shuffled again.
g = torch.Generator().manual_seed(args.seed)
perm = torch.randperm(len(examples), generator=g).tolist()
bs = args.train_batch_size
if args.bucket_batches > 0:
    micro = []
    bucket = bs * args.bucket_batches
    for s in range(0, len(perm), bucket):
        chunk = sorted(perm[s:s + bucket], key=lambda i: len(examples[i][0]), reverse=True)
        micro.extend(chunk[k:k + bs] for k in range(0, len(chunk), bs))
    micro = [micro[k] for k in torch.randperm(len(micro), generator=g).tolist()]
else:
    micro = [perm[k:k + bs] for k in range(0, len(perm), bs)]


def collate(batch):
    """Right padding; attention mask 0 and labels -100 on the padding."""
    width = max(len(examples[i][0]) for i in batch)
    ids = torch.full((len(batch), width), PAD, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for r, i in enumerate(batch):
        x, y = examples[i]
        ids[r, :len(x)] = torch.tensor(x)
        labels[r, :len(y)] = torch.tensor(y)
        mask[r, :len(x)] = 1
    return ids, mask, labels


steps = [micro[k:k + args.grad_accum] for k in range(0, len(micro), args.grad_accum)]
total_steps = len(steps)
params = [q for q in model.parameters() if q.requires_grad]
opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                        weight_decay=args.weight_decay)
sched = get_cosine_schedule_with_warmup(opt, math.ceil(args.warmup_ratio * total_steps), total_steps)

# --- Training: one epoch. ---
t = time.perf_counter()
model.train()
label_tokens = 0
for step in steps:
    batches = [collate(b) for b in step]
    # Global token normalisation: the model's own loss with `num_items_in_batch` (transformers'
    # ForCausalLMLoss: CE with reduction="sum" over the shifted labels, divided by
    # num_items_in_batch) given the step's count of shifted label tokens, so that the
    # accumulated gradient is that of sum(CE over the step) / count, as ours.
    count = sum(int((labels[:, 1:] != -100).sum()) for _, _, labels in batches)
    label_tokens += count
    step_loss = 0.0
    for ids, mask, labels in batches:
        loss = model(input_ids=ids, attention_mask=mask, labels=labels,
                     num_items_in_batch=count).loss * args.ce_weight
        loss.backward()
        step_loss += loss.item()
    torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
ckpt = os.path.join(args.out, "checkpoint-epoch-0")
model.save_pretrained(ckpt)
torch.save(opt.state_dict(), os.path.join(ckpt, "optimizer.pt"))
torch.save(sched.state_dict(), os.path.join(ckpt, "scheduler.pt"))
train_s = time.perf_counter() - t
total = time.perf_counter() - started

print(f"hf:      pipeline {total:.1f} s (setup {setup_s:.1f} s, generation {gen_s:.1f} s = "
      f"{generated / gen_s:.1f} tokens/s, training {train_s:.1f} s = "
      f"{label_tokens / train_s:.1f} tokens/s)")
print(f"hf:      {len(prompts)} prompts, {generated} generated tokens, {total_steps} optimizer steps, "
      f"{label_tokens} label tokens, last step loss {step_loss:.4f} (torch {torch.__version__}, "
      f"transformers {transformers.__version__}, peft {peft.__version__})")
