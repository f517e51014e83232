#!/usr/bin/env python3
"""PyTorch (CPU, eager, float32) twin of `benches/src/bin/linear_kd.rs`: one case per process.

The student's logits come from its LM head, `logits = h @ W.T` (h [N, 512] requires grad,
W [V, 512] frozen), and the KD objective is written as a strong PyTorch user writes it:
one `log_softmax` per side (the teacher's under `torch.no_grad`), the objective as a sum over
the vocabulary (or the teacher's top-k), a masked sum / N, then `backward()` to h.

  full vocabulary: t_lp = log_softmax(t / tau), s_lp = log_softmax(logits / tau)
  top-k (K = 64):  t_lp = log_softmax(values / tau) over K;
                   s_lp = log_softmax(logits.gather(1, idx) / tau) over K (ROLL's renormalised)
  forward_kl:      sum p (t_lp - s_lp)
  js_divergence:   m = (p + q) / 2; 0.5 sum p (t_lp - log m) + 0.5 sum q (s_lp - log m)

Inputs as the Rust side draws them (shapes and distributions; not the same values): h ~ N(0,1),
W ~ N(0, 0.05), teacher logits / top-k values ~ N(0, 2), top-k indices uniform, 10% of rows
masked. Peak extra memory: VmHWM after one cold forward + backward minus VmRSS before it (the
peak reset through /proc/self/clear_refs), the gradient of h included; time: the median of
--repeats calls after --warmup.

    OMP_WAIT_POLICY=PASSIVE python benches/linear_kd_pytorch.py --case 1024,topk,forward_kl
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--case", required=True, help="rows,mode,objective")
p.add_argument("--hidden", type=int, default=512)
p.add_argument("--vocab", type=int, default=128256)
p.add_argument("--repeats", type=int, default=3)
p.add_argument("--warmup", type=int, default=1)
p.add_argument("--threads", type=int, default=2)
args = p.parse_args()
torch.set_num_threads(args.threads)
torch.manual_seed(0)

rows, mode, objective = args.case.split(",")
n, d, v, K, tau = int(rows), args.hidden, args.vocab, 64, 1.0
h = torch.randn(n, d).requires_grad_(True)
W = torch.randn(v, d) * 0.05
mask = torch.tensor([i % 10 != 3 for i in range(n)], dtype=torch.float32)
count = float(mask.sum())
if mode == "full":
    t = torch.randn(n, v) * 2.0
else:
    values = torch.randn(n, K) * 2.0
    idx = torch.randint(0, v, (n, K))


def vm(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def step():
    logits = h @ W.T
    with torch.no_grad():
        t_lp = F.log_softmax((t if mode == "full" else values) / tau, dim=-1)
        pt = t_lp.exp()
    s = logits if mode == "full" else logits.gather(1, idx)
    s_lp = F.log_softmax(s / tau, dim=-1)
    if objective == "forward_kl":
        per_row = (pt * (t_lp - s_lp)).sum(-1)
    elif objective == "js_divergence":
        q = s_lp.exp()
        log_m = torch.log(0.5 * (pt + q) + 1e-9)
        per_row = 0.5 * (pt * (t_lp - log_m)).sum(-1) + 0.5 * (q * (s_lp - log_m)).sum(-1)
    else:
        raise SystemExit(f"unknown objective {objective}")
    loss = (per_row * mask).sum() / count
    h.grad = None
    loss.backward()
    return float(loss)


base = vm("VmRSS")
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    reset = True
except OSError:
    reset = False
loss = step()
extra = vm("VmHWM") - base if reset else None
for _ in range(args.warmup):
    step()
times = []
cpu0, wall0 = time.process_time(), time.perf_counter()
for _ in range(args.repeats):
    t0 = time.perf_counter()
    step()
    times.append((time.perf_counter() - t0) * 1e3)
cpu = (time.process_time() - cpu0) / max(time.perf_counter() - wall0, 1e-9)
print(json.dumps({"case": args.case, "median_ms": statistics.median(times), "min_ms": min(times),
                  "max_ms": max(times), "cpu_per_wall": cpu, "extra_bytes": extra, "loss": loss,
                  "torch": torch.__version__}))
