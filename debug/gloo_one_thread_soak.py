"""graphzero-soak with every gloo process group on one worker thread (two collectives never run at
once), for the crash hunt (docs/reliability.md): the rank pool's workaround, shared. Run each rank
under a launcher: a spawned rank would import graphzero_tools.soak without this swap."""
import sys

from graphzero_tools.gloo_threads import one_worker_thread_per_gloo_group

one_worker_thread_per_gloo_group()
from graphzero_tools.soak import main

if __name__ == "__main__":
    sys.exit(main())
