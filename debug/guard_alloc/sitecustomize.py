"""Loaded by every Python process started with this folder on PYTHONPATH (spawned ranks included):
with GRAPHZERO_GUARD_ALLOC=1 it installs guard_alloc.cpp as torch's CPU allocator, every tensor
on pages of its own with a PROT_NONE page after it and freed tensors kept PROT_NONE for a while, so
a write into freed or out-of-bounds tensor memory faults at the writer (its native stack printed
by the module's signal handler). Slow and memory-hungry: a crash hunt, not a test."""
import os

if os.environ.get("GRAPHZERO_GUARD_ALLOC") == "1":
    import sys

    from torch.utils.cpp_extension import load

    _here = os.path.dirname(os.path.abspath(__file__))
    _build = os.environ.get("GRAPHZERO_GUARD_BUILD", "/tmp/graphzero-guard-alloc")
    os.makedirs(_build, exist_ok=True)
    load("guard_alloc", [os.path.join(_here, "guard_alloc.cpp")], build_directory=_build).install(
        int(os.environ.get("GRAPHZERO_GUARD_QUARANTINE", "20000")))
    print(f"[guard_alloc] installed in pid {os.getpid()}", file=sys.stderr, flush=True)
