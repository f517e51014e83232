#!/usr/bin/env python3
"""PyTorch (CPU, eager, float32) side of the kd-loss benchmark.

Each objective is written the straightforward way typical distillation code (ROLL and
similar) writes it: softmax / log_softmax over the whole [N, V] tensor, elementwise
products, -inf masking with masked_fill, torch.sort for adaptive_kl, then a row-masked
sum / N. Every call is forward + backward w.r.t. the student logits (and, for hidden_mse,
the student hidden state and the projection weight).

Workload (defaults): N = 1024 rows x V = 128256 (Llama 3 vocabulary) float32 logits,
student and teacher ~ N(0, 2) (std 2, seeded), 10% of rows masked out, tau = 2.0,
tau_T = 1.0, lam = 0.1, alpha_A = 0.5, full-vocabulary mode; cross-entropy uses random
targets (-100 on the masked rows). hidden_mse: N = 1024, student hidden 2048 ->
Linear(2048, 4096, bias=False) -> squared error against a teacher hidden 4096,
sum / (N * 4096) over counted rows.

Per objective (each in a fresh subprocess with torch.set_num_threads(--threads, default 2)
and OMP_WAIT_POLICY=PASSIVE):
  * peak extra memory: inputs allocated (student with requires_grad, teacher, mask,
    targets), VmRSS read from /proc/self/status as the baseline, the peak reset with
    `echo 5 > /proc/self/clear_refs`, one forward + backward, then VmHWM is read;
    extra = VmHWM - baseline (includes the gradient buffer(s)). Measured before any
    warm-up, i.e. cold, in a process that has run nothing else.
  * time: median (and min / max) of --repeats timed calls after --warmup calls, in ms;
    CPU time / wall time over the timed calls (about --threads when the machine is idle;
    clearly less means the run was disturbed and should be discarded), and the
    1-minute load average before and after.

Usage (machine otherwise idle):

    OMP_WAIT_POLICY=PASSIVE /work/venv/bin/python benches/losses_pytorch.py
    OMP_WAIT_POLICY=PASSIVE /work/venv/bin/python benches/losses_pytorch.py \\
        --objectives forward_kl,adaptive_kl --json /tmp/out.json
    /work/venv/bin/python benches/losses_pytorch.py --smoke     # tiny shapes, proves it runs

Options: --rows, --vocab, --repeats (10), --warmup (2), --threads (2), --seed (0),
--objectives (comma list, default all), --json (default benches/results/losses_pytorch.json;
--smoke defaults to benches/results/losses_pytorch_smoke.json). Full size needs roughly
5-6 GiB of RAM per subprocess.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

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


# ---------------------------------------------------------------------------------------
# Objectives (float32, eager). s: student logits [N, V] (requires grad), t: teacher [N, V],
# m: row mask [N] float32 (1 = counted), n: normaliser (counted rows).
# ---------------------------------------------------------------------------------------


def _reduce(per_row, m, n):
    return (per_row * m).sum() / n


def forward_kl(F, torch, s, t, m, n, c):
    tau, tt = c["tau"], c["tau_T"]
    t_probs = F.softmax(t / (tau * tt), dim=-1)
    t_lprobs = F.log_softmax(t / (tau * tt), dim=-1)
    s_lprobs = F.log_softmax(s / tau, dim=-1)
    inf_mask = torch.isinf(s) | torch.isinf(t)
    kl = torch.masked_fill(t_probs * (t_lprobs - s_lprobs), inf_mask, 0.0).sum(-1)
    return _reduce(kl, m, n)


def reverse_kl(F, torch, s, t, m, n, c):
    tau, tt = c["tau"], c["tau_T"]
    s_probs = F.softmax(s / tau, dim=-1)
    s_lprobs = F.log_softmax(s / tau, dim=-1)
    t_lprobs = F.log_softmax(t / (tau * tt), dim=-1)
    inf_mask = torch.isinf(s) | torch.isinf(t)
    kl = torch.masked_fill(s_probs * (s_lprobs - t_lprobs), inf_mask, 0.0).sum(-1)
    return _reduce(kl, m, n)


def skewed_forward_kl(F, torch, s, t, m, n, c):
    tau, tt, lam = c["tau"], c["tau_T"], c["lam"]
    s_probs = F.softmax(s / tau, dim=-1)
    t_probs = F.softmax(t / (tau * tt), dim=-1)
    t_lprobs = F.log_softmax(t / (tau * tt), dim=-1)
    mixed_lprobs = torch.log(lam * t_probs + (1 - lam) * s_probs)
    inf_mask = torch.isinf(s) | torch.isinf(t)
    kl = torch.masked_fill(t_probs * (t_lprobs - mixed_lprobs), inf_mask, 0.0).sum(-1)
    return _reduce(kl, m, n)


def skewed_reverse_kl(F, torch, s, t, m, n, c):
    tau, tt, lam = c["tau"], c["tau_T"], c["lam"]
    s_probs = F.softmax(s / tau, dim=-1)
    s_lprobs = F.log_softmax(s / tau, dim=-1)
    t_probs = F.softmax(t / (tau * tt), dim=-1)
    mixed_lprobs = torch.log((1 - lam) * t_probs + lam * s_probs)
    inf_mask = torch.isinf(s) | torch.isinf(t)
    kl = torch.masked_fill(s_probs * (s_lprobs - mixed_lprobs), inf_mask, 0.0).sum(-1)
    return _reduce(kl, m, n)


def js_divergence(F, torch, s, t, m, n, c):
    tau, tt = c["tau"], c["tau_T"]
    eps = 1e-9
    p = F.softmax(t / (tau * tt), dim=-1)
    q = F.softmax(s / tau, dim=-1)
    mid = 0.5 * (p + q)
    log_mid = torch.log(mid + eps)
    js = 0.5 * (p * (torch.log(p + eps) - log_mid)) + 0.5 * (q * (torch.log(q + eps) - log_mid))
    inf_mask = torch.isinf(s) | torch.isinf(t)
    js = torch.masked_fill(js, inf_mask, 0.0).sum(-1)
    return _reduce(js, m, n)


def tv_distance(F, torch, s, t, m, n, c):
    tau, tt = c["tau"], c["tau_T"]
    p = F.softmax(t / (tau * tt), dim=-1)
    q = F.softmax(s / tau, dim=-1)
    inf_mask = torch.isinf(s) | torch.isinf(t)
    tv = 0.5 * torch.masked_fill((p - q).abs(), inf_mask, 0.0).sum(-1)
    return _reduce(tv, m, n)


def adaptive_kl(F, torch, s, t, m, n, c):
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
    return _reduce(akl, m, n)


def cross_entropy(F, torch, s, targets, n):
    return F.cross_entropy(s, targets, ignore_index=-100, reduction="sum") / n


KD_FNS = {f.__name__: f for f in (forward_kl, reverse_kl, skewed_forward_kl,
                                  skewed_reverse_kl, js_divergence, tv_distance, adaptive_kl)}


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
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(True)
    g = torch.Generator().manual_seed(args.seed)
    obj = args.worker
    N, V = args.rows, args.vocab
    cfg = dict(tau=args.tau, tau_T=args.tau_t, lam=args.lam, alpha_A=args.alpha)

    n_masked = N // 10
    mask_bool = torch.ones(N, dtype=torch.bool)
    mask_bool[torch.randperm(N, generator=g)[:n_masked]] = False
    mask = mask_bool.float()
    n_count = float(mask_bool.sum())

    if obj == "hidden_mse":
        d_s, d_t = args.d_student, args.d_teacher
        h_s = torch.randn(N, d_s, generator=g).requires_grad_(True)
        h_t = torch.randn(N, d_t, generator=g)
        proj = torch.nn.Linear(d_s, d_t, bias=False)
        with torch.no_grad():
            proj.weight.copy_(torch.randn(d_t, d_s, generator=g) / d_s ** 0.5)
        params = [h_s, proj.weight]

        def step():
            out = proj(h_s)
            per_row = ((out - h_t) ** 2).sum(-1)
            loss = (per_row * mask).sum() / (n_count * d_t)
            loss.backward()
            return loss
    else:
        student = torch.randn(N, V, generator=g).mul_(2.0).requires_grad_(True)
        params = [student]
        if obj == "cross_entropy":
            targets = torch.randint(0, V, (N,), generator=g)
            targets[~mask_bool] = -100

            def step():
                loss = cross_entropy(F, torch, student, targets, n_count)
                loss.backward()
                return loss
        else:
            teacher = torch.randn(N, V, generator=g).mul_(2.0)
            fn = KD_FNS[obj]

            def step():
                loss = fn(F, torch, student, teacher, mask, n_count, cfg)
                loss.backward()
                return loss

    def clear_grads():
        for p in params:
            p.grad = None

    # ---- peak extra memory: one cold forward + backward ----
    baseline = read_status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    hwm_reset = read_status_kib("VmHWM")
    loss = step()
    hwm = read_status_kib("VmHWM")
    loss_value = float(loss)
    grad_norm = float(sum(p.grad.double().pow(2).sum() for p in params) ** 0.5)
    clear_grads()
    del loss

    # ---- timing ----
    for _ in range(args.warmup):
        step()
        clear_grads()
    load_before = loadavg1()
    walls, cpus = [], []
    for _ in range(args.repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        step()
        w1, c1 = time.perf_counter(), time.process_time()
        clear_grads()
        walls.append(w1 - w0)
        cpus.append(c1 - c0)
    load_after = loadavg1()

    res = dict(
        objective=obj,
        median_ms=statistics.median(walls) * 1e3,
        min_ms=min(walls) * 1e3,
        max_ms=max(walls) * 1e3,
        times_ms=[w * 1e3 for w in walls],
        cpu_over_wall=sum(cpus) / sum(walls),
        peak_extra_mib=(hwm - baseline) / 1024.0,
        baseline_rss_mib=baseline / 1024.0,
        vmhwm_after_reset_mib=hwm_reset / 1024.0,
        loss=loss_value,
        grad_norm=grad_norm,
        loadavg1_before=load_before,
        loadavg1_after=load_after,
        torch_threads=torch.get_num_threads(),
    )
    print("RESULT " + json.dumps(res), flush=True)


# ---------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--d-student", type=int, default=2048)
    ap.add_argument("--d-teacher", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
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
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        args.rows, args.vocab = 64, 4096
        args.d_student, args.d_teacher = 256, 512
        args.repeats, args.warmup = 2, 1
    if args.json is None:
        name = "losses_pytorch_smoke.json" if args.smoke else "losses_pytorch.json"
        args.json = os.path.join(HERE, "results", name)
    return args


def run_one(args, obj):
    env = dict(os.environ)
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    env["OMP_NUM_THREADS"] = str(args.threads)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", obj,
           "--rows", str(args.rows), "--vocab", str(args.vocab),
           "--d-student", str(args.d_student), "--d-teacher", str(args.d_teacher),
           "--repeats", str(args.repeats), "--warmup", str(args.warmup),
           "--threads", str(args.threads), "--seed", str(args.seed),
           "--tau", str(args.tau), "--tau-t", str(args.tau_t), "--lam", str(args.lam),
           "--alpha", str(args.alpha)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout + proc.stderr)
        return dict(objective=obj, error=f"worker exited {proc.returncode}")
    return json.loads(lines[-1][len("RESULT "):])


def main():
    args = parse_args()
    if args.worker:
        worker(args)
        return
    objectives = [o.strip() for o in args.objectives.split(",") if o.strip()]
    unknown = [o for o in objectives if o not in ALL]
    if unknown:
        sys.exit(f"unknown objectives: {unknown}; known: {ALL}")

    import torch  # only for the version string; the driver itself does no work

    config = dict(rows=args.rows, vocab=args.vocab, d_student=args.d_student,
                  d_teacher=args.d_teacher, masked_fraction=0.1, logit_std=2.0,
                  tau=args.tau, tau_T=args.tau_t, lam=args.lam, alpha_A=args.alpha,
                  mode="full_vocab", dtype="float32", repeats=args.repeats,
                  warmup=args.warmup, threads=args.threads, seed=args.seed,
                  smoke=args.smoke)
    env = dict(torch=torch.__version__, python=platform.python_version(),
               machine=platform.machine(), cpu_count=os.cpu_count(),
               omp_wait_policy_subprocess="PASSIVE",
               omp_wait_policy_parent=os.environ.get("OMP_WAIT_POLICY"))
    print(f"PyTorch {torch.__version__} eager f32, N={args.rows} V={args.vocab} "
          f"threads={args.threads} repeats={args.repeats} warmup={args.warmup}"
          + (" [SMOKE]" if args.smoke else ""))
    hdr = (f"{'objective':18s} {'median ms':>10s} {'min ms':>9s} {'max ms':>9s} "
           f"{'cpu/wall':>8s} {'peak extra MiB':>14s} {'load1':>6s} {'loss':>12s}")
    print(hdr)
    print("-" * len(hdr))
    results = {}
    for obj in objectives:
        r = run_one(args, obj)
        results[obj] = r
        if "error" in r:
            print(f"{obj:18s} ERROR {r['error']}")
            continue
        print(f"{obj:18s} {r['median_ms']:10.2f} {r['min_ms']:9.2f} {r['max_ms']:9.2f} "
              f"{r['cpu_over_wall']:8.2f} {r['peak_extra_mib']:14.1f} "
              f"{r['loadavg1_after']:6.2f} {r['loss']:12.6g}", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(dict(config=config, env=env, results=results), f, indent=1)
        f.write("\n")
    print(f"wrote {args.json}")
    if any("error" in r for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
