"""fp32 ZeRO-1/2 engines under the lean step keep this rank's partition once, not twice.

With fp32 parameters DeepSpeed holds each param group's partition twice: in the flat parameter
buffer (``parallel_partitioned_bit16_groups[i][rank]``, which the module's parameters view) and
as the optimizer's fp32 master (``single_partition_of_fp32_groups[i]``), and after every update
copies the second into the first. With one dtype and one device that copy carries nothing: here
the master's ``.data`` becomes the flat buffer's partition, so the update writes the parameters
themselves, the lean step's copy has nothing left to do (it is skipped: 0.65 ms per engine and
step on the gan's 3 MiB partitions, CPU), and each rank holds one partition less.

What DeepSpeed reads stays as it was: the master tensor object, the optimizer state keyed by it,
checkpoints (a load copies into the master, so into the parameters too), its own ``step()`` (its
copy is then a tensor copied onto itself). Its ``_hp_mapping`` fragments
(``deepspeed.utils.safe_get_full_fp32_param``) are views of the master's storage, so they are
re-made on the new storage after each change. One difference, by design: a parameter changed in
place between steps (``module.load_state_dict`` after ``deepspeed.initialize``) changes this
rank's master with it; DeepSpeed would overwrite the change at the next step. Where the two copies differ when the
alias is made, the parameters' values are kept, so the next forward and the update see the same
weights.

Undone on detach (and whenever the step is re-chosen): the master gets a storage of its own again,
holding the current values. A DeepSpeed call that moves the master (``offload_states``) ends the
alias; the lean step then copies as DeepSpeed does (``aliased``).
"""
from __future__ import annotations

import torch

from .ds_internals import ds_attr
from .ledger import PatchLedger


def partition(opt, i: int, rank: int) -> torch.Tensor:
    """This rank's partition of group ``i`` in the flat parameter buffer."""
    return opt.parallel_partitioned_bit16_groups[i][rank]


def aliased(master: torch.Tensor, part: torch.Tensor) -> bool:
    return master.data_ptr() == part.data_ptr() and master.numel() == part.numel()


def alias_masters(opt, ranks: list[int], ledger: PatchLedger) -> list[int]:
    """Point each fp32 master at its partition of the flat buffer where both are fp32 on one device;
    returns the groups aliased. ``ranks``: this rank in each group's data-parallel group."""
    done = []
    for i, master in enumerate(opt.single_partition_of_fp32_groups):
        part = partition(opt, i, ranks[i])
        if (master.dtype != torch.float32 or part.dtype != torch.float32 or master.device != part.device
                or master.shape != part.shape or not part.is_contiguous() or aliased(master, part)):
            continue
        master.data = part.data
        done.append(i)
    if done:
        ledger.on_undo(lambda: _unalias(opt, done), "the fp32 masters' own storage")
        _repoint_fragments(opt, done)
    return done


def _unalias(opt, groups: list[int]) -> None:
    for i in groups:
        master = opt.single_partition_of_fp32_groups[i]
        master.data = master.data.clone()
    _repoint_fragments(opt, groups)


def _repoint_fragments(opt, groups: list[int]) -> None:
    """Each parameter's fp32 fragment (``_hp_mapping.hp_fragment``, a narrow of the master that
    ``safe_get_full_fp32_param`` reads) re-made on the master's current storage, in the same
    mapping object."""
    for i in groups:
        master = opt.single_partition_of_fp32_groups[i]
        for param in opt.bit16_groups[i]:
            mapping = getattr(param, "_hp_mapping", None)
            if mapping is not None:
                address = ds_attr(mapping, "hp_fragment_address")
                mapping.hp_fragment = master.narrow(0, address.start, address.numel)
