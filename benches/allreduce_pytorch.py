"""The PyTorch twin of benches/src/bin/allreduce.rs: torch.distributed all_reduce (SUM) over
the gloo backend — what CPU data-parallel PyTorch (DDP, FSDP on CPU) uses — of the same f32
and f64 buffers, the same number of ranks on this machine, one warm-up then timed iterations.

    python benches/allreduce_pytorch.py --ranks 2 --params 45000000 --iters 5
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank, ranks, params, iters, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    for dtype in (torch.float32, torch.float64):
        buf = (torch.arange(params, dtype=torch.int64) % 97).to(dtype) * 1e-3 + rank
        dist.all_reduce(buf)
        times = []
        for _ in range(iters):
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(buf)
            times.append(time.perf_counter() - t)
        times.sort()
        if rank == 0:
            median = times[len(times) // 2]
            mb = params * buf.element_size() / 1e6
            n = ranks
            name = "f32" if dtype == torch.float32 else "f64"
            print(
                f"pytorch {torch.__version__} gloo {n} ranks, {mb:.1f} MB {name}: median "
                f"{median * 1e3:.1f} ms, algbw {mb / median:.0f} MB/s, "
                f"busbw {mb / median * 2 * (n - 1) / n:.0f} MB/s",
                flush=True,
            )
        del buf
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--params", type=int, default=45_000_000)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--port", type=int, default=29517)
    a = p.parse_args()
    mp.spawn(rank_main, args=(a.ranks, a.params, a.iters, a.port), nprocs=a.ranks, join=True)


if __name__ == "__main__":
    main()
