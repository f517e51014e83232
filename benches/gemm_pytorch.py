#!/usr/bin/env python3
"""PyTorch twin of benches/src/bin/gemm.rs: `a @ b` in f32 on the train step's shapes, 2 threads,
median of --repeats. Run by the bench (which sets OMP_WAIT_POLICY=PASSIVE and, for the capped
row, ATEN_CPU_CAPABILITY / MKL_ENABLE_INSTRUCTIONS / ONEDNN_MAX_CPU_ISA); alone:

    OMP_WAIT_POLICY=PASSIVE python benches/gemm_pytorch.py
"""

import argparse
import time

import torch

SHAPES = [(1024, 512, 512), (1024, 512, 1408), (1024, 1408, 512), (1024, 512, 32768), (1024, 128256, 512)]

p = argparse.ArgumentParser()
p.add_argument("--repeats", type=int, default=7)
p.add_argument("--label", default="native")
args = p.parse_args()
torch.set_num_threads(2)
for m, k, n in SHAPES:
    a = torch.randn(m, k)
    b = torch.randn(k, n)
    a @ b
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    t = sorted(times)[len(times) // 2]
    print(f"pytorch {args.label:<6} [{m}×{k}]·[{k}×{n}]: {m * k * n / t / 1e9:.1f} G multiply-adds/s")
