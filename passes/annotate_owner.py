"""annotate_owner: find each owned parameter's gradient among the backward graph's outputs.

Inserts nothing. The output node's ``meta["desc"][k]`` says which forward input slot k is the
gradient of; slots of owned parameters (ZeRO-3: shards) become ``ctx.grads``, the gradient node
tagged ``meta["graphzero_owner"]`` with the parameter's name.
"""
from __future__ import annotations

from torch import fx

from ._graph import GradOutput, PassContext, output_node
from .contract import pass_contract


def _grad_of_input_index(desc) -> int | None:
    grad_of = getattr(desc, "grad_of", None)
    return getattr(grad_of, "idx", None)


@pass_contract(provides={"grads"})
def annotate_owner(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    out = output_node(gm)
    values = list(out.args[0])
    descs = out.meta.get("desc")
    if descs is None or len(descs) != len(values):
        raise RuntimeError("graphzero: the backward graph's output node has no AOT descriptors "
                           f"(meta['desc']); cannot map gradients to parameters (torch {__import__('torch').__version__})")
    for slot, (value, desc) in enumerate(zip(values, descs)):
        idx = _grad_of_input_index(desc)
        owned = ctx.ownership.inputs.get(idx) if idx is not None else None
        if owned is None or not isinstance(value, fx.Node):
            continue
        shape = tuple(value.meta["val"].shape)
        expected = (owned.param_set.groups[owned.group].shard_numel_of(owned.position),) if owned.shard \
            else tuple(owned.param.shape)
        if shape != expected:
            raise RuntimeError(f"graphzero: backward output {slot} should be the gradient of {owned.qualname} "
                               f"{expected} but has shape {shape}")
        value.meta["graphzero_owner"] = owned.qualname
        ctx.grads.append(GradOutput(slot, value, owned))
    return gm
