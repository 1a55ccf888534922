"""graphzero-soak with every gloo process group on one worker thread (two collectives never run at
once), for the crash hunt (docs/reliability.md). Run each rank under a launcher: a spawned rank
would import graphzero_tools.soak without this swap."""
import sys

import torch.distributed.distributed_c10d as dc

_real = dc.ProcessGroupGloo


class _OneThreadGloo(_real):
    def __init__(self, store, rank, size, timeout=None):
        o = _real._Options()
        o._devices = [_real.create_default_device()]
        if timeout is not None:
            o._timeout = timeout
        o._threads = 1
        super().__init__(store, rank, size, o)


dc.ProcessGroupGloo = _OneThreadGloo
from graphzero_tools.soak import main

if __name__ == "__main__":
    sys.exit(main())
