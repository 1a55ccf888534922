"""Plain torch, no graphzero, no DeepSpeed: the per-step collective sequence of the compiled ZeRO-3
GAN step on gloo, through the functional collectives (``torch.ops._c10d_functional``) that
inductor's code calls: the forward's all-gathers (two in flight), the rank agreement's blocking
all-gather, the backward's reduce-scatters lowered to ``all_to_all_single`` with one-sided split
sizes (two in flight, each waited with ``wait_tensor`` later, while the main thread allocates), and
the folded norms' asynchronous all-reduces, waited in the next step (``--backward-only``: the
reduce-scatters alone; ``--one-thread``: every gloo process group on one worker thread).

Run: ``bash debug/functional_alltoall_soak.sh [iterations]`` (two ranks on this machine). A crash
here (glibc "unaligned tcache chunk", SIGSEGV) is torch's or gloo's, not graphzero's.
"""
import sys
import time

import torch
import torch.distributed as dist

c10d = torch.ops._c10d_functional


def main(iterations: int, backward_only: bool) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD.group_name
    sizes = (2113, 1057, 16904 // 4, 33280 // 4, 64, 8)
    norms: list = []
    start = time.time()
    for it in range(iterations):
        if not backward_only:
            for work in norms:   # the previous step's folded norms
                work.wait()
            gathered = [c10d.all_gather_into_tensor(torch.randn(n), world, group) for n in sizes[:4]]
            for g in gathered:
                c10d.wait_tensor(g).sum()
            mine, every = torch.full((2,), it, dtype=torch.int64), torch.empty(2 * world, dtype=torch.int64)
            dist.all_gather_into_tensor(every, mine)   # the rank agreement
        works = []
        for n in sizes:
            src = torch.randn(2 * n)
            # rank r keeps chunk r: it sends the other chunk, receives the other rank's (as lowered)
            split = [0, n] if rank == 0 else [n, 0]
            out = c10d.all_to_all_single(src[n:] if rank == 0 else src[:n], split, split, group)
            works.append(out)
            if len(works) > 2:   # at most two in flight, as the compiled backward's schedule
                c10d.wait_tensor(works.pop(0)).sum()
            churn = [torch.empty(k * 37) for k in range(1, 40)]   # the main thread allocates meanwhile
            del churn
        for w in works:
            c10d.wait_tensor(w).sum()
        if not backward_only:
            norms = [dist.all_reduce(torch.ones(1), async_op=True) for _ in range(2)]
        if it % 5000 == 0 and rank == 0:
            print(f"iteration {it}/{iterations}, {time.time() - start:.0f} s", flush=True)
    dist.barrier()
    if rank == 0:
        print(f"done: {iterations} iterations, no crash", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if "--one-thread" in sys.argv:   # the rank pool's workaround, shared
        from graphzero_tools.gloo_threads import one_worker_thread_per_gloo_group
        one_worker_thread_per_gloo_group()
    main(int(args[0]) if args else 100_000, "--backward-only" in sys.argv)
