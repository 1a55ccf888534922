"""Gloo process groups with one worker thread: the workaround for torch's gloo heap corruption.

With gloo's default two worker threads per process group, collectives of different kinds in flight
together on one group corrupt the heap now and then (glibc ``malloc(): unaligned tcache chunk
detected``, or a SIGSEGV, after thousands of steps). It reproduces in plain torch 2.13 without
graphzero or DeepSpeed (``debug/functional_alltoall_soak.py``; docs/reliability.md, "the native
crash, found"); with one worker thread per group it has not. NCCL is not affected.

Call :func:`one_worker_thread_per_gloo_group` before ``init_process_group`` (graphzero's test
ranks do, and ``graphzero-soak --one-gloo-thread``).
"""
from __future__ import annotations


def one_worker_thread_per_gloo_group() -> None:
    """Build every ProcessGroupGloo of this process with one worker thread (torch offers no option
    for it: ``init_process_group`` and ``new_group`` build gloo groups with two)."""
    import torch.distributed.distributed_c10d as c10d
    gloo = c10d.ProcessGroupGloo
    if getattr(gloo, "one_worker_thread", False):
        return

    class OneThreadGloo(gloo):
        one_worker_thread = True

        def __init__(self, store, rank, size, timeout=None, **rest):
            # torch >= 2.15 also passes enable_reconfigure (off unless asked for)
            unsupported = {k: v for k, v in rest.items() if v}
            if unsupported:
                raise RuntimeError(f"one_worker_thread_per_gloo_group: {unsupported} not supported")
            options = gloo._Options()
            options._devices = [gloo.create_default_device()]
            if timeout is not None:
                options._timeout = timeout
            options._threads = 1
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = OneThreadGloo
