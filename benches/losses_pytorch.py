#!/usr/bin/env python3
"""PyTorch (CPU, eager, float32) side of the kd-loss benchmark.

Each objective is written the way a strong PyTorch user writes it (the definitions are
docs/src/loss-contract.md, full-vocabulary mode): the teacher side under torch.no_grad(), one
normalisation per side (log_softmax, and .exp() of it where the probabilities are needed
too; a plain softmax where a side needs only probabilities), no Python loops, no second
softmax, no needless copies or casts, and the row mask applied to the [N] per-row losses by
a boolean index (per_row[mask].sum() / N). Every call is forward + backward w.r.t. the
student logits (and, for hidden_mse, the student hidden state and the projection weight).

Entries where a logit is +-inf are dropped from the per-row sums (ROLL's `inf_mask`, kept
from the first version of this script so the values do not change). That elementwise mask
costs several passes over [N, V], so the twins check first, in two read-only passes, whether
the inputs hold any non-finite value at all, and take the masked formulation only then; the
benchmark's inputs are finite, so the timed path is the unmasked one.

Workload (defaults): N = 1024 rows x V = 128256 (Llama 3 vocabulary) float32 logits,
student and teacher ~ N(0, 2) (std 2, seeded), 10% of rows masked out, tau = 2.0,
tau_T = 1.0, lam = 0.1, alpha_A = 0.5, full-vocabulary mode; cross-entropy uses random
targets (-100 on the masked rows). hidden_mse: N = 1024, student hidden 2048 ->
Linear(2048, 4096, bias=False) -> squared error against a teacher hidden 4096,
sum / (N * 4096) over counted rows.

Per objective (each in a fresh subprocess with torch.set_num_threads(--threads, default 2)
and OMP_WAIT_POLICY=PASSIVE); the driver prints each objective's row as soon as it is
measured:
  * peak extra memory: inputs allocated (student with requires_grad, teacher, mask,
    targets), VmRSS read from /proc/self/status as the baseline, the peak reset with
    `echo 5 > /proc/self/clear_refs`, one forward + backward, then VmHWM is read;
    extra = VmHWM - baseline (includes the gradient buffer(s)). Measured before any
    warm-up, i.e. cold, in a process that has run nothing else.
  * time: median (and min / max) of --repeats timed calls after --warmup calls, in ms,
    stopping early once the timed calls have taken --max-seconds (but after at least 3;
    `repeats_done` says how many), so that the slowest objectives (adaptive_kl's sort)
    do not dominate the run; CPU time / wall time over the timed calls (about --threads
    when the machine is idle; clearly less means the run was disturbed and should be
    discarded), and the 1-minute load average before and after.

Usage (machine otherwise idle):

    OMP_WAIT_POLICY=PASSIVE /work/venv/bin/python benches/losses_pytorch.py
    OMP_WAIT_POLICY=PASSIVE /work/venv/bin/python benches/losses_pytorch.py \\
        --objectives forward_kl,adaptive_kl --json /tmp/out.json
    /work/venv/bin/python benches/losses_pytorch.py --smoke     # tiny shapes, proves it runs
    /work/venv/bin/python benches/losses_pytorch.py --check     # new twins == old ones
    /work/venv/bin/python benches/losses_pytorch.py --vs-old --rows 256 \\
        --objectives forward_kl                                 # time old and new twins

Options: --rows (1024), --vocab (128256), --repeats (5), --warmup (1), --max-seconds (20;
0 = no cap), --threads (2), --seed (0), --objectives (comma list, default all), --json
(default benches/results/losses_pytorch.json; --smoke defaults to
benches/results/losses_pytorch_smoke.json), --retain-freed-memory (glibc malloc keeps freed
memory instead of unmapping it, as jemalloc / tcmalloc do: eager PyTorch's per-op [N, V]
allocations otherwise page-fault afresh on every call, ~3x the time at this size; off by
default, recorded in the JSON; setting MALLOC_MMAP_MAX_=0 and MALLOC_TRIM_THRESHOLD_=
1099511627776 in the environment of a whole `loss_figures` run gives both columns the same
allocator). Full size needs up to ~5.5 GiB of RAM per subprocess (peak extra ~2 GiB for
forward_kl, ~5 GiB for js_divergence and adaptive_kl).

--check (N = 64, V = 1000 unless --rows / --vocab are given) computes every twin and the
first version's formulation of it (the `_old_*` functions below) on finite inputs and on
inputs with -inf entries (a vocabulary mask on both sides, teacher-only, student-only), under
two configurations, and asserts that the losses agree to 1e-5 relative and the gradients to
1e-5 relative (L2 norm of the difference); it also prints the largest elementwise gradient
difference and both twins' errors against the old formulation evaluated in float64. (At
V = 128256 and a sharp configuration the largest elementwise difference reaches ~2e-5 of
the largest entry, and the L2 one ~1.2e-5 for skewed_reverse_kl: both twins are that far
from float64 there, float32's limit; such a row passes, marked "(f32 limit)", when the new
twin is no further from float64 than the old one, and within 1e-4 of it.)
--vs-old times the old and the new twin of each objective, interleaved, in one process.
"""

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))

KD_OBJECTIVES = [
    "forward_kl",
    "reverse_kl",
    "skewed_forward_kl",
    "skewed_reverse_kl",
    "js_divergence",
    "tv_distance",
    "adaptive_kl",
]
ALL = ["cross_entropy"] + KD_OBJECTIVES + ["hidden_mse"]
MIN_REPEATS = 3  # timed calls an objective gets even when --max-seconds is spent


# ---------------------------------------------------------------------------------------
# Objectives (float32, eager). s: student logits [N, V] (requires grad), t: teacher [N, V],
# mask: row mask [N] bool (True = counted), n: normaliser (counted rows), c: config dict.
# p = softmax(t / (tau * tau_T)) (teacher), q = softmax(s / tau) (student).
#
# Row sums of products are torch.linalg.vecdot(a, b) = (a * b).sum(-1). (A batched BLAS
# dot, torch.bmm / einsum, is a few % faster but accumulates naively in float32 and drifts
# ~1e-5 relative from the other formulations at V = 128256.) Where the teacher term
# Σ p·log p is split off, it is computed under no_grad, which saves the subtraction and its
# backward; the split costs no accuracy worth naming here (--check).
#
# Row mask: per_row[mask].sum() / n. Indexing the [N] per-row vector and a weighted sum
# (per_row * mask_f).sum() cost the same (the index also keeps a NaN in an uncounted row out
# of the loss, where the weighted sum of the first version let it through); selecting the
# counted rows of s and t *before* the [N, V] work (s[mask], t[mask]) was ~15% slower (two
# copies, and a zero-filled scatter in backward, cost more than the 10% of rows it saves).
# ---------------------------------------------------------------------------------------

vecdot = torch.linalg.vecdot


def _all_finite(s, t):
    """No +-inf / NaN in either logit tensor: a finite sum of all entries implies it (any
    +-inf or NaN makes the sum non-finite; an overflowing sum of finite values only sends
    us, correctly, down the slower masked path). Two read-only passes, ~1-2% of a call."""
    with torch.no_grad():
        return bool(torch.isfinite(s.sum()) & torch.isfinite(t.sum()))


def _sum_finite_entries(x, s, t):
    """Σ_v x with the entries where either logit is +-inf dropped (ROLL's inf_mask)."""
    return x.masked_fill(torch.isinf(s) | torch.isinf(t), 0.0).sum(-1)


def _teacher_log_probs(t, c):
    """log p and p = exp(log p) of the teacher, no grad (one log_softmax)."""
    with torch.no_grad():
        logp = F.log_softmax(t / (c["tau"] * c["tau_T"]), dim=-1)
        return logp, logp.exp()


# forward_kl = Σ_v p (log p − log q), computed as Σ p log p (teacher, no grad) − Σ p log q.
def forward_kl(s, t, mask, n, c):
    finite = _all_finite(s, t)
    logp, p = _teacher_log_probs(t, c)
    logq = F.log_softmax(s / c["tau"], dim=-1)
    if finite:
        with torch.no_grad():
            p_logp = vecdot(p, logp)
        kl = p_logp - vecdot(p, logq)
    else:
        kl = _sum_finite_entries(p * (logp - logq), s, t)
    return kl[mask].sum() / n


# reverse_kl = Σ_v q (log q − log p), q = exp(log q) of the one student log_softmax.
def reverse_kl(s, t, mask, n, c):
    finite = _all_finite(s, t)
    with torch.no_grad():
        logp = F.log_softmax(t / (c["tau"] * c["tau_T"]), dim=-1)
    logq = F.log_softmax(s / c["tau"], dim=-1)
    q = logq.exp()
    if finite:
        kl = vecdot(q, logq - logp)
    else:
        kl = _sum_finite_entries(q * (logq - logp), s, t)
    return kl[mask].sum() / n


# skewed_forward_kl = Σ_v p (log p − log(λ p + (1 − λ) q)), as Σ p log p − Σ p log mix.
# Mixture in probability space: one fused add and one log; logaddexp(log λ + log p,
# log(1 − λ) + log q) is ~25% slower (exp + log1p per entry, forward and backward) and buys
# nothing here, because mix ≥ λ p > 0 wherever p > 0 (the entries that carry weight). The
# student needs only q, so its one normalisation is a softmax (10-20% faster than
# log_softmax(...).exp(), whose backward is two passes where softmax's is one).
def skewed_forward_kl(s, t, mask, n, c):
    lam = c["lam"]
    finite = _all_finite(s, t)
    logp, p = _teacher_log_probs(t, c)
    with torch.no_grad():
        lam_p = lam * p
    q = F.softmax(s / c["tau"], dim=-1)
    log_mix = torch.add(lam_p, q, alpha=1.0 - lam).log()
    if finite:
        with torch.no_grad():
            p_logp = vecdot(p, logp)
        kl = p_logp - vecdot(p, log_mix)
    else:
        kl = _sum_finite_entries(p * (logp - log_mix), s, t)
    return kl[mask].sum() / n


# skewed_reverse_kl = Σ_v q (log q − log((1 − λ) p + λ q)). Mixture in probability space
# (~10% faster than logaddexp; mix ≥ λ q > 0 wherever q > 0). The teacher needs only p, so
# its one normalisation is a softmax (scaled by 1 − λ in place).
def skewed_reverse_kl(s, t, mask, n, c):
    lam = c["lam"]
    finite = _all_finite(s, t)
    with torch.no_grad():
        p_scaled = F.softmax(t / (c["tau"] * c["tau_T"]), dim=-1).mul_(1.0 - lam)
    logq = F.log_softmax(s / c["tau"], dim=-1)
    q = logq.exp()
    log_mix = torch.add(p_scaled, q, alpha=lam).log()
    if finite:
        kl = vecdot(q, logq - log_mix)
    else:
        kl = _sum_finite_entries(q * (logq - log_mix), s, t)
    return kl[mask].sum() / n


# js_divergence = ½ Σ_v p (log(p+ε) − log(m+ε)) + ½ Σ_v q (log(q+ε) − log(m+ε)),
# m = (p + q) / 2, ε = 1e-9 (losses.md keeps ε inside the logs, so log p from a
# log_softmax would change the value: ε·V ~ 1e-4 per row). Computed as
# ½ [Σ p log(p+ε) (teacher, no grad) − Σ p log(m+ε) + Σ q (log(q+ε) − log(m+ε))];
# m + ε = (½ p + ε) + ½ q is one fused add. Both sides need only probabilities: a softmax each.
def js_divergence(s, t, mask, n, c):
    eps = 1e-9
    finite = _all_finite(s, t)
    with torch.no_grad():
        p = F.softmax(t / (c["tau"] * c["tau_T"]), dim=-1)
        log_p = (p + eps).log_()
        half_p_eps = p.mul(0.5).add_(eps)
    q = F.softmax(s / c["tau"], dim=-1)
    log_m = torch.add(half_p_eps, q, alpha=0.5).log()
    log_q = (q + eps).log()
    if finite:
        with torch.no_grad():
            p_logp = vecdot(p, log_p)
        js = 0.5 * (p_logp - vecdot(p, log_m) + vecdot(q, log_q - log_m))
    else:
        js = 0.5 * _sum_finite_entries(p * (log_p - log_m) + q * (log_q - log_m), s, t)
    return js[mask].sum() / n


# tv_distance = ½ Σ_v |p − q|. Both sides need only probabilities: a softmax each.
def tv_distance(s, t, mask, n, c):
    finite = _all_finite(s, t)
    with torch.no_grad():
        p = F.softmax(t / (c["tau"] * c["tau_T"]), dim=-1)
    q = F.softmax(s / c["tau"], dim=-1)
    if finite:
        tv = 0.5 * (q - p).abs().sum(-1)
    else:
        tv = 0.5 * _sum_finite_entries((q - p).abs(), s, t)
    return tv[mask].sum() / n


# adaptive_kl = w_head · forward_kl + w_tail · reverse_kl (Wu et al. 2024, ROLL's form):
# sort p ascending (one torch.sort), q in the same order; tail = sorted positions with
# cumsum(sorted p) ≤ α_A, head = the rest; g_head = Σ_head |p − q|, g_tail = Σ_tail |p − q|;
# w_head = g_head / (g_head + g_tail), w_tail = g_tail / (g_head + g_tail). The weights are
# constants (no gradient), so they are computed under no_grad, from the same p and q.
def adaptive_kl(s, t, mask, n, c):
    finite = _all_finite(s, t)
    logp, p = _teacher_log_probs(t, c)
    logq = F.log_softmax(s / c["tau"], dim=-1)
    q = logq.exp()
    with torch.no_grad():
        p_sorted, order = p.sort(dim=-1)
        gap = (p_sorted - q.gather(-1, order)).abs_()
        tail = p_sorted.cumsum_(dim=-1) <= c["alpha_A"]
        g_tail = gap.where(tail, 0.0).sum(-1)
        g_head = gap.where(~tail, 0.0).sum(-1)
        total = g_head + g_tail
        w_head, w_tail = g_head / total, g_tail / total
    if finite:
        with torch.no_grad():
            p_logp = vecdot(p, logp)
        fkl = p_logp - vecdot(p, logq)
        rkl = vecdot(q, logq - logp)
    else:
        fkl = _sum_finite_entries(p * (logp - logq), s, t)
        rkl = _sum_finite_entries(q * (logq - logp), s, t)
    akl = w_head * fkl + w_tail * rkl
    return akl[mask].sum() / n


# cross_entropy = Σ_{labels ≠ −100} −log softmax(s)[label] / N (F.cross_entropy, one fused
# log_softmax + nll; unchanged from the first version).
def cross_entropy(s, targets, n):
    return F.cross_entropy(s, targets, ignore_index=-100, reduction="sum") / n


# hidden_mse = Σ_{counted t} Σ_j (W h_S − h_T)²_{t,j} / (N · d_T). The counted rows are
# selected before the projection (copies of the counted rows of h_S and h_T; they save the
# masked rows' share of the matmul and its backward, 5-10% here), then
# F.mse_loss(reduction="sum").
def hidden_mse(h_s, h_t, weight, mask, n):
    return F.mse_loss(F.linear(h_s[mask], weight), h_t[mask], reduction="sum") / (
        n * h_t.shape[-1])


KD_FNS = {f.__name__: f for f in (forward_kl, reverse_kl, skewed_forward_kl,
                                  skewed_reverse_kl, js_divergence, tv_distance, adaptive_kl)}


# ---------------------------------------------------------------------------------------
# The first version's twins, verbatim (m: row mask [N] float32), for --check and --vs-old.
# ---------------------------------------------------------------------------------------


def _old_reduce(per_row, m, n):
    return (per_row * m).sum() / n


def _old_forward_kl(F, torch, s, t, m, n, c):
    tau, tt = c["tau"], c["tau_T"]
    t_probs = F.softmax(t / (tau * tt), dim=-1)
    t_lprobs = F.log_softmax(t / (tau * tt), dim=-1)
    s_lprobs = F.log_softmax(s / tau, dim=-1)
    inf_mask = torch.isinf(s) | torch.isinf(t)
    kl = torch.masked_fill(t_probs * (t_lprobs - s_lprobs), inf_mask, 0.0).sum(-1)
    return _old_reduce(kl, m, n)


def _old_reverse_kl(F, torch, s, t, m, n, c):
    tau, tt = c["tau"], c["tau_T"]
    s_probs = F.softmax(s / tau, dim=-1)
    s_lprobs = F.log_softmax(s / tau, dim=-1)
    t_lprobs = F.log_softmax(t / (tau * tt), dim=-1)
    inf_mask = torch.isinf(s) | torch.isinf(t)
    kl = torch.masked_fill(s_probs * (s_lprobs - t_lprobs), inf_mask, 0.0).sum(-1)
    return _old_reduce(kl, m, n)


def _old_skewed_forward_kl(F, torch, s, t, m, n, c):
    tau, tt, lam = c["tau"], c["tau_T"], c["lam"]
    s_probs = F.softmax(s / tau, dim=-1)
    t_probs = F.softmax(t / (tau * tt), dim=-1)
    t_lprobs = F.log_softmax(t / (tau * tt), dim=-1)
    mixed_lprobs = torch.log(lam * t_probs + (1 - lam) * s_probs)
    inf_mask = torch.isinf(s) | torch.isinf(t)
    kl = torch.masked_fill(t_probs * (t_lprobs - mixed_lprobs), inf_mask, 0.0).sum(-1)
    return _old_reduce(kl, m, n)


def _old_skewed_reverse_kl(F, torch, s, t, m, n, c):
    tau, tt, lam = c["tau"], c["tau_T"], c["lam"]
    s_probs = F.softmax(s / tau, dim=-1)
    s_lprobs = F.log_softmax(s / tau, dim=-1)
    t_probs = F.softmax(t / (tau * tt), dim=-1)
    mixed_lprobs = torch.log((1 - lam) * t_probs + lam * s_probs)
    inf_mask = torch.isinf(s) | torch.isinf(t)
    kl = torch.masked_fill(s_probs * (s_lprobs - mixed_lprobs), inf_mask, 0.0).sum(-1)
    return _old_reduce(kl, m, n)


def _old_js_divergence(F, torch, s, t, m, n, c):
    tau, tt = c["tau"], c["tau_T"]
    eps = 1e-9
    p = F.softmax(t / (tau * tt), dim=-1)
    q = F.softmax(s / tau, dim=-1)
    mid = 0.5 * (p + q)
    log_mid = torch.log(mid + eps)
    js = 0.5 * (p * (torch.log(p + eps) - log_mid)) + 0.5 * (q * (torch.log(q + eps) - log_mid))
    inf_mask = torch.isinf(s) | torch.isinf(t)
    js = torch.masked_fill(js, inf_mask, 0.0).sum(-1)
    return _old_reduce(js, m, n)


def _old_tv_distance(F, torch, s, t, m, n, c):
    tau, tt = c["tau"], c["tau_T"]
    p = F.softmax(t / (tau * tt), dim=-1)
    q = F.softmax(s / tau, dim=-1)
    inf_mask = torch.isinf(s) | torch.isinf(t)
    tv = 0.5 * torch.masked_fill((p - q).abs(), inf_mask, 0.0).sum(-1)
    return _old_reduce(tv, m, n)


def _old_adaptive_kl(F, torch, s, t, m, n, c):
    tau, tt, alpha = c["tau"], c["tau_T"], c["alpha_A"]
    s_probs = F.softmax(s / tau, dim=-1)
    t_probs = F.softmax(t / (tau * tt), dim=-1)
    sorted_t, sorted_idx = t_probs.sort(dim=-1)
    sorted_s = s_probs.gather(-1, sorted_idx)
    gap = (sorted_t - sorted_s).abs()
    tail = (torch.cumsum(sorted_t, dim=-1) <= alpha).float()
    g_head = (gap * (1 - tail)).sum(-1).detach()
    g_tail = (gap * tail).sum(-1).detach()
    s_lprobs = F.log_softmax(s / tau, dim=-1)
    t_lprobs = F.log_softmax(t / (tau * tt), dim=-1)
    inf_mask = torch.isinf(s) | torch.isinf(t)
    fkl = torch.masked_fill(t_probs * (t_lprobs - s_lprobs), inf_mask, 0.0).sum(-1)
    rkl = torch.masked_fill(s_probs * (s_lprobs - t_lprobs), inf_mask, 0.0).sum(-1)
    tot = g_head + g_tail
    akl = (g_head / tot) * fkl + (g_tail / tot) * rkl
    return _old_reduce(akl, m, n)


def _old_cross_entropy(F, torch, s, targets, n):
    return F.cross_entropy(s, targets, ignore_index=-100, reduction="sum") / n


def _old_hidden_mse(h_s, h_t, weight, m, n):
    out = F.linear(h_s, weight)
    per_row = ((out - h_t) ** 2).sum(-1)
    return (per_row * m).sum() / (n * h_t.shape[-1])


OLD_KD_FNS = {name: globals()["_old_" + name] for name in KD_OBJECTIVES}


# ---------------------------------------------------------------------------------------
# Inputs, and one objective's step (shared by the worker, --check and --vs-old)
# ---------------------------------------------------------------------------------------


def make_inputs(obj, N, V, d_s, d_t, seed):
    """The benchmark's inputs for one objective (same RNG sequence as the first version)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(N, dtype=torch.bool)
    mask[torch.randperm(N, generator=g)[: N // 10]] = False
    x = dict(mask=mask, mask_f=mask.float(), n=float(mask.sum()))
    if obj == "hidden_mse":
        x["h_s"] = torch.randn(N, d_s, generator=g).requires_grad_(True)
        x["h_t"] = torch.randn(N, d_t, generator=g)
        x["weight"] = (torch.randn(d_t, d_s, generator=g) / d_s ** 0.5).requires_grad_(True)
        x["params"] = [x["h_s"], x["weight"]]
        return x
    x["s"] = torch.randn(N, V, generator=g).mul_(2.0).requires_grad_(True)
    x["params"] = [x["s"]]
    if obj == "cross_entropy":
        targets = torch.randint(0, V, (N,), generator=g)
        targets[~mask] = -100
        x["targets"] = targets
    else:
        x["t"] = torch.randn(N, V, generator=g).mul_(2.0)
    return x


def loss_fn(obj, x, cfg, old=False):
    """A closure computing the objective's loss on inputs x (new twin, or the old one)."""
    if obj == "hidden_mse":
        if old:
            return lambda: _old_hidden_mse(x["h_s"], x["h_t"], x["weight"], x["mask_f"], x["n"])
        return lambda: hidden_mse(x["h_s"], x["h_t"], x["weight"], x["mask"], x["n"])
    if obj == "cross_entropy":
        if old:
            return lambda: _old_cross_entropy(F, torch, x["s"], x["targets"], x["n"])
        return lambda: cross_entropy(x["s"], x["targets"], x["n"])
    if old:
        fn = OLD_KD_FNS[obj]
        return lambda: fn(F, torch, x["s"], x["t"], x["mask_f"], x["n"], cfg)
    fn = KD_FNS[obj]
    return lambda: fn(x["s"], x["t"], x["mask"], x["n"], cfg)


def make_step(obj, x, cfg, old=False):
    f = loss_fn(obj, x, cfg, old)

    def step():
        loss = f()
        loss.backward()
        return loss

    return step


def clear_grads(x):
    for p in x["params"]:
        p.grad = None


def config_of(args):
    return dict(tau=args.tau, tau_T=args.tau_t, lam=args.lam, alpha_A=args.alpha)


# ---------------------------------------------------------------------------------------
# Worker (one objective, fresh process)
# ---------------------------------------------------------------------------------------


def read_status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def loadavg1():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def worker(args):
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(True)
    obj = args.worker
    x = make_inputs(obj, args.rows, args.vocab, args.d_student, args.d_teacher, args.seed)
    step = make_step(obj, x, config_of(args))
    params = x["params"]

    # ---- peak extra memory: one cold forward + backward ----
    baseline = read_status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    hwm_reset = read_status_kib("VmHWM")
    loss = step()
    hwm = read_status_kib("VmHWM")
    loss_value = float(loss.detach())
    grad_norm = float(sum(p.grad.double().pow(2).sum() for p in params) ** 0.5)
    clear_grads(x)
    del loss

    # ---- timing ----
    for _ in range(args.warmup):
        step()
        clear_grads(x)
    load_before = loadavg1()
    walls, cpus = [], []
    for _ in range(args.repeats):
        if 0 < args.max_seconds <= sum(walls) and len(walls) >= MIN_REPEATS:
            break  # the cap: enough timed calls for a median, and the budget is spent
        w0, c0 = time.perf_counter(), time.process_time()
        step()
        w1, c1 = time.perf_counter(), time.process_time()
        clear_grads(x)
        walls.append(w1 - w0)
        cpus.append(c1 - c0)
    load_after = loadavg1()

    res = dict(
        objective=obj,
        median_ms=statistics.median(walls) * 1e3,
        min_ms=min(walls) * 1e3,
        max_ms=max(walls) * 1e3,
        times_ms=[w * 1e3 for w in walls],
        repeats_done=len(walls),
        cpu_over_wall=sum(cpus) / sum(walls),
        peak_extra_mib=(hwm - baseline) / 1024.0,
        baseline_rss_mib=baseline / 1024.0,
        vmhwm_after_reset_mib=hwm_reset / 1024.0,
        loss=loss_value,
        grad_norm=grad_norm,
        loadavg1_before=load_before,
        loadavg1_after=load_after,
        torch_threads=torch.get_num_threads(),
        retain_freed_memory=retains_freed_memory(),
    )
    print("RESULT " + json.dumps(res), flush=True)


# ---------------------------------------------------------------------------------------
# --check: new twins against the old ones (values and gradients)
# ---------------------------------------------------------------------------------------


def _loss_and_grads(obj, x, cfg, old):
    clear_grads(x)
    loss = loss_fn(obj, x, cfg, old)()
    loss.backward()
    grads = [p.grad.detach().clone() for p in x["params"]]
    clear_grads(x)
    return float(loss.detach()), grads


def _rel(a, b):
    if math.isnan(a) and math.isnan(b):
        return 0.0
    return abs(a - b) / max(abs(b), 1e-30)


def _grad_err(ga, gb):
    """(||ga - gb|| / ||gb||, max |ga - gb| / max |gb|) over all gradient tensors; NaN where
    they disagree on which entries are NaN."""
    d2 = b2 = dmax = bmax = 0.0
    for a, b in zip(ga, gb):
        if not torch.equal(torch.isnan(a), torch.isnan(b)):
            return float("nan"), float("nan")
        a, b = a.nan_to_num(0.0).double(), b.nan_to_num(0.0).double()
        d2, b2 = d2 + float((a - b).pow(2).sum()), b2 + float(b.pow(2).sum())
        dmax, bmax = max(dmax, float((a - b).abs().max())), max(bmax, float(b.abs().max()))
    return (d2 / max(b2, 1e-300)) ** 0.5, dmax / max(bmax, 1e-30)


def _with_inf(x, case, seed):
    """Puts -inf entries into the logits: ~5% of each row's entries, on one or both sides."""
    if case == "finite":
        return x
    g = torch.Generator().manual_seed(seed + 1)
    sel = torch.rand(x["s"].shape, generator=g) < 0.05
    with torch.no_grad():
        if case in ("vocab_mask", "student_-inf"):
            x["s"].masked_fill_(sel, float("-inf"))
        if case in ("vocab_mask", "teacher_-inf"):
            x["t"].masked_fill_(sel, float("-inf"))
    return x


def check(args):
    torch.set_num_threads(args.threads)
    tol = 1e-5
    cfgs = [config_of(args), dict(tau=1.0, tau_T=0.7, lam=0.3, alpha_A=0.3)]
    objectives = [o for o in args.objective_list]
    print(f"--check: N={args.rows} V={args.vocab}, new twin vs old (f32): loss rel = "
          f"|new - old| / |old|, grad rel = ||new - old|| / ||old||, both must be <= {tol:g}; "
          "grad max = max |new - old| / max |old| (shown, not asserted); err64 / g64 = "
          "loss rel / grad rel of each against the old formulation evaluated in float64; "
          "'(f32 limit)': beyond the tolerance, but the new twin is no further from float64 "
          "than the old one", flush=True)
    hdr = (f"{'objective':18s} {'case':13s} {'cfg':>3s} {'loss new':>13s} {'loss rel':>9s} "
           f"{'grad rel':>9s} {'grad max':>9s} {'old err64':>9s} {'new err64':>9s} "
           f"{'old g64':>9s} {'new g64':>9s}")
    print(hdr)
    print("-" * len(hdr), flush=True)
    failures = []
    for obj in objectives:
        kd = obj in KD_FNS
        cases = ["finite", "vocab_mask", "teacher_-inf", "student_-inf"] if kd else ["finite"]
        for ci, cfg in enumerate(cfgs if kd else cfgs[:1]):
            for case in cases:
                x = _with_inf(make_inputs(obj, args.rows, args.vocab, args.d_student,
                                          args.d_teacher, args.seed), case, args.seed)
                new_l, new_g = _loss_and_grads(obj, x, cfg, old=False)
                old_l, old_g = _loss_and_grads(obj, x, cfg, old=True)
                lrel, (gerr, gmax) = _rel(new_l, old_l), _grad_err(new_g, old_g)
                # float64 evaluation of the old formulation, as the reference for both
                x64 = {k: (v.detach().double().requires_grad_(v.requires_grad)
                           if torch.is_tensor(v) and v.is_floating_point() else v)
                       for k, v in x.items() if k != "params"}
                x64["params"] = [x64[k] for k in ("s", "h_s", "weight") if k in x64]
                ref_l, ref_g = _loss_and_grads(obj, x64, cfg, old=True)
                old64, new64 = _rel(old_l, ref_l), _rel(new_l, ref_l)
                gold64, gnew64 = _grad_err(old_g, ref_g)[0], _grad_err(new_g, ref_g)[0]
                # Agreement within tol, or (float32's limit: both twins about tol away from
                # float64) the new twin no less accurate than the old. NaN compares False.
                l_ok = lrel <= tol or new64 <= min(old64, 10 * tol)
                g_ok = gerr <= tol or gnew64 <= min(gold64, 10 * tol)
                ok = l_ok and g_ok
                mark = "" if lrel <= tol and gerr <= tol else "  (f32 limit)" if ok else "  FAIL"
                if not ok:
                    failures.append(f"{obj} {case} cfg{ci}")
                print(f"{obj:18s} {case:13s} {ci:3d} {new_l:13.7g} {lrel:9.1e} {gerr:9.1e} "
                      f"{gmax:9.1e} "
                      f"{old64:9.1e} {new64:9.1e} {gold64:9.1e} {gnew64:9.1e}"
                      + mark, flush=True)
    if failures:
        sys.exit(f"--check FAILED: {', '.join(failures)}")
    print("--check passed: every twin matches the old formulation (values and gradients)")


# ---------------------------------------------------------------------------------------
# --vs-old: time the old and the new twin of each objective, interleaved, in one process
# ---------------------------------------------------------------------------------------


def vs_old(args):
    torch.set_num_threads(args.threads)
    cfg = config_of(args)
    print(f"--vs-old: N={args.rows} V={args.vocab} threads={args.threads} "
          f"repeats={args.repeats} warmup={args.warmup}, old and new calls interleaved "
          "(alternating which goes first)"
          + (", malloc=retain" if retains_freed_memory() else ""), flush=True)
    hdr = f"{'objective':18s} {'old ms':>9s} {'new ms':>9s} {'new/old':>8s} {'loss rel':>9s}"
    print(hdr)
    print("-" * len(hdr), flush=True)
    out = {}
    for obj in args.objective_list:
        x = make_inputs(obj, args.rows, args.vocab, args.d_student, args.d_teacher, args.seed)
        steps = dict(old=make_step(obj, x, cfg, old=True), new=make_step(obj, x, cfg))
        losses = {k: float(st().detach()) for k, st in steps.items()}
        clear_grads(x)
        for _ in range(args.warmup):
            for st in steps.values():
                st()
                clear_grads(x)
        times = dict(old=[], new=[])
        for r in range(args.repeats):
            for k in (("old", "new") if r % 2 == 0 else ("new", "old")):
                st = steps[k]
                w0 = time.perf_counter()
                st()
                times[k].append((time.perf_counter() - w0) * 1e3)
                clear_grads(x)
        med = {k: statistics.median(v) for k, v in times.items()}
        out[obj] = dict(old_ms=times["old"], new_ms=times["new"], losses=losses)
        print(f"{obj:18s} {med['old']:9.1f} {med['new']:9.1f} {med['new'] / med['old']:8.2f} "
              f"{_rel(losses['new'], losses['old']):9.1e}", flush=True)
        del x, steps
    return out


# ---------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=None, help="default 1024 (--check: 64)")
    ap.add_argument("--vocab", type=int, default=None, help="default 128256 (--check: 1000)")
    ap.add_argument("--d-student", type=int, default=None, help="default 2048 (--check: 64)")
    ap.add_argument("--d-teacher", type=int, default=None, help="default 4096 (--check: 96)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--max-seconds", type=float, default=20.0,
                    help=f"stop an objective's timed calls once they took this long "
                         f"(at least {MIN_REPEATS} of them); 0 = no cap")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tau", type=float, default=2.0)
    ap.add_argument("--tau-t", type=float, default=1.0)
    ap.add_argument("--lam", type=float, default=0.1)
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--objectives", default=",".join(ALL))
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes (N=64, V=4096, hidden 256->512, 2 repeats, 1 warm-up)")
    ap.add_argument("--check", action="store_true",
                    help="assert every twin equals the old formulation (values, gradients)")
    ap.add_argument("--vs-old", action="store_true",
                    help="time old and new twins, interleaved, in one process")
    ap.add_argument("--retain-freed-memory", action="store_true",
                    help="re-run with glibc malloc keeping freed memory (MALLOC_MMAP_MAX_=0, "
                         "MALLOC_TRIM_THRESHOLD_=1 TiB), as jemalloc / tcmalloc would")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    small = args.check
    defaults = dict(rows=(64 if small else 1024), vocab=(1000 if small else 128256),
                    d_student=(64 if small else 2048), d_teacher=(96 if small else 4096))
    if args.smoke:
        defaults = dict(rows=64, vocab=4096, d_student=256, d_teacher=512)
        args.repeats, args.warmup = 2, 1
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.json is None:
        name = "losses_pytorch_smoke.json" if args.smoke else "losses_pytorch.json"
        args.json = os.path.join(HERE, "results", name)
    args.objective_list = [o.strip() for o in args.objectives.split(",") if o.strip()]
    return args


def run_one(args, obj):
    env = dict(os.environ)
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    env["OMP_NUM_THREADS"] = str(args.threads)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", obj,
           "--rows", str(args.rows), "--vocab", str(args.vocab),
           "--d-student", str(args.d_student), "--d-teacher", str(args.d_teacher),
           "--repeats", str(args.repeats), "--warmup", str(args.warmup),
           "--max-seconds", str(args.max_seconds),
           "--threads", str(args.threads), "--seed", str(args.seed),
           "--tau", str(args.tau), "--tau-t", str(args.tau_t), "--lam", str(args.lam),
           "--alpha", str(args.alpha)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout + proc.stderr)
        return dict(objective=obj, error=f"worker exited {proc.returncode}")
    return json.loads(lines[-1][len("RESULT "):])


# glibc serves each [N, V] tensor (0.5 GiB at full size) with a fresh mmap and unmaps it
# when freed, so every eager op's output is page-faulted and zeroed again: at N = 256 that
# is well over half of a call's time (sys time). PyTorch's CPU tuning guide's answer is
# jemalloc / tcmalloc; these two glibc settings do the same (freed memory stays in the heap).
# Off by default, so that the figures stay comparable with earlier ones; recorded in the JSON.
RETAIN_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}


def retains_freed_memory():
    return all(os.environ.get(k) == v for k, v in RETAIN_ENV.items())


def main():
    args = parse_args()
    if args.retain_freed_memory and not retains_freed_memory():
        # malloc reads these at start-up: re-run this process (workers inherit them)
        os.execve(sys.executable, [sys.executable] + sys.argv, {**os.environ, **RETAIN_ENV})
    if args.worker:
        worker(args)
        return
    objectives = args.objective_list
    unknown = [o for o in objectives if o not in ALL]
    if unknown:
        sys.exit(f"unknown objectives: {unknown}; known: {ALL}")
    if args.check:
        check(args)
        return
    if args.vs_old:
        vs_old(args)
        return

    config = dict(rows=args.rows, vocab=args.vocab, d_student=args.d_student,
                  d_teacher=args.d_teacher, masked_fraction=0.1, logit_std=2.0,
                  tau=args.tau, tau_T=args.tau_t, lam=args.lam, alpha_A=args.alpha,
                  mode="full_vocab", dtype="float32", repeats=args.repeats,
                  warmup=args.warmup, max_seconds=args.max_seconds,
                  min_repeats=MIN_REPEATS, threads=args.threads, seed=args.seed,
                  smoke=args.smoke, twins="v2: no_grad teacher, one normalisation per side",
                  retain_freed_memory=retains_freed_memory())
    env = dict(torch=torch.__version__, python=platform.python_version(),
               machine=platform.machine(), cpu_count=os.cpu_count(),
               omp_wait_policy_subprocess="PASSIVE",
               omp_wait_policy_parent=os.environ.get("OMP_WAIT_POLICY"))
    print(f"PyTorch {torch.__version__} eager f32, N={args.rows} V={args.vocab} "
          f"threads={args.threads} repeats={args.repeats} warmup={args.warmup} "
          f"max-seconds={args.max_seconds:g}"
          + (" malloc=retain" if retains_freed_memory() else "")
          + (" [SMOKE]" if args.smoke else ""), flush=True)
    hdr = (f"{'objective':18s} {'median ms':>10s} {'min ms':>9s} {'max ms':>9s} {'n':>3s} "
           f"{'cpu/wall':>8s} {'peak extra MiB':>14s} {'load1':>6s} {'loss':>12s}")
    print(hdr)
    print("-" * len(hdr), flush=True)
    results = {}
    for obj in objectives:
        r = run_one(args, obj)
        results[obj] = r
        if "error" in r:
            print(f"{obj:18s} ERROR {r['error']}", flush=True)
            continue
        print(f"{obj:18s} {r['median_ms']:10.2f} {r['min_ms']:9.2f} {r['max_ms']:9.2f} "
              f"{r['repeats_done']:3d} {r['cpu_over_wall']:8.2f} {r['peak_extra_mib']:14.1f} "
              f"{r['loadavg1_after']:6.2f} {r['loss']:12.6g}", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(dict(config=config, env=env, results=results), f, indent=1)
        f.write("\n")
    print(f"wrote {args.json}", flush=True)
    if any("error" in r for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
