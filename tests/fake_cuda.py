"""A process group reported as NCCL and a CUDA device emulated on CPU tensors, to check device
placement where no GPU exists (tests/test_device_placement.py).

Only the backend lookup is mocked: ``torch.distributed.get_backend`` answers "nccl" and
``torch.cuda.current_device`` answers 0, so ``graphzero.devices.collective_device`` says what it
would say on a GPU rank: ``cuda:0``. The collectives themselves are the real gloo ones.

`FakeCuda` (a TorchFunctionMode) makes ``cuda:0`` a device tensors can be created on: a factory
call or ``.to``/``.cuda`` asking for it runs on the CPU and the result is marked as on cuda:0;
marked inputs mark an op's outputs (as a device propagates), and ``t.data = v`` gives ``t`` the
mark of ``v``; a marked tensor reports ``.device == cuda:0``. The engine's own tensors (its
parameters, flat buffers, optimizer state: the `roots`) count as on cuda:0, as they would be on
a GPU, and DeepSpeed's accelerator names cuda:0 too. A tensor created without a device, or on a
hard-coded CPU, stays plain CPU: exactly the tensors NCCL would reject.

Every collective (the ``torch.distributed`` functions and ``_c10d_functional`` ops) records the
devices of the tensors handed to it, the device `collective_device` names for its group, and the
graphzero frame that issued it; host reads of marked tensors (``.item()``, ``.tolist()``,
``bool()``) are recorded as host syncs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import weakref
from unittest import mock

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

FAKE = torch.device("cuda", 0)
_CPU = torch.device("cpu")
_COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "broadcast",
                "all_gather", "reduce_scatter", "all_to_all_single", "reduce")
_HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "numpy")
_DEVICE_GET, _IS_CUDA_GET = torch.Tensor.device.__get__, torch.Tensor.is_cuda.__get__
_DATA_SET = torch.Tensor.data.__set__
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_GRAPHZERO_DIRS = tuple(os.path.dirname(m.__file__) + os.sep
                        for m in (__import__("graphzero"), __import__("graphzero.passes").passes))


@dataclasses.dataclass
class Call:
    name: str
    devices: list[torch.device]
    expected: torch.device
    origin: str | None   # "file:line" of the innermost graphzero frame, None: not graphzero's


def _origin() -> str | None:
    """"file:line" when the code that made this call (the innermost frame outside torch and this
    file) is graphzero's, else None (DeepSpeed's own step, the test)."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename == __file__
                                 or frame.f_code.co_filename.startswith(_TORCH_DIR)):
        frame = frame.f_back
    if frame is None or not frame.f_code.co_filename.startswith(_GRAPHZERO_DIRS):
        return None
    root = os.path.dirname(_GRAPHZERO_DIRS[0].rstrip(os.sep))
    return f"{os.path.relpath(frame.f_code.co_filename, root)}:{frame.f_lineno}"


def _is_fake(device) -> bool:
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda"


class FakeCuda(TorchFunctionMode):
    def __init__(self, roots: list[torch.Tensor]) -> None:
        super().__init__()
        self._marked: dict[int, weakref.ref] = {}
        self._roots = [t for t in roots if t.numel()]     # kept alive: their storages cannot be reused
        self._root_ptrs = {t.untyped_storage().data_ptr() for t in self._roots}
        # ZeRO-3 parameters are empty (their shard is in ds_tensor) and live on the GPU: by identity
        self._mark([t for t in roots if not t.numel()])
        self.calls: list[Call] = []
        self.host_syncs: list[tuple[str, str | None]] = []
        self.mixed: list[tuple[str, str | None]] = []

    # -- marks ------------------------------------------------------------------------------------
    def on_fake(self, t: torch.Tensor) -> bool:
        with torch._C.DisableTorchFunction():
            ref = self._marked.get(id(t))
            if ref is not None and ref() is t:
                return True
            return t.device.type == "cpu" and t.numel() > 0 and t.untyped_storage().data_ptr() in self._root_ptrs

    def device_of(self, t: torch.Tensor) -> torch.device:
        with torch._C.DisableTorchFunction():
            return FAKE if self.on_fake(t) else t.device

    def _mark(self, out) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._marked[id(t)] = weakref.ref(t)

    # -- the mode ---------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func == _DEVICE_GET:
            return self.device_of(args[0])
        if func == _IS_CUDA_GET:
            return self.on_fake(args[0])
        if func is torch.Tensor.get_device:
            return 0 if self.on_fake(args[0]) else func(*args, **kwargs)
        if func == _DATA_SET:
            # ``t.data = v``: t takes v's storage, so v's device (by storage, or marked by identity)
            target, value = args
            fake = self.on_fake(value)
            func(*args, **kwargs)
            if fake:
                self._mark(target)
            else:
                self._marked.pop(id(target), None)
            return None
        if func is torch.Tensor.backward:
            # A handler runs with the mode popped, and calling backward again would come back here:
            # run the engine directly, with the mode on, so that the backward's hooks see it.
            rest = list(args[1:]) + list(kwargs.values())
            assert args[0].dim() == 0 and not any(rest), f"the tests call loss.backward() only, not {rest}"
            with self:
                torch.autograd.Variable._execution_engine.run_backward(
                    (args[0],), (torch.ones_like(args[0]),), False, False, (), allow_unreachable=True,
                    accumulate_grad=True)
            return None
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        name = getattr(func, "__name__", str(func))
        if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            namespace, op = str(func).split(".")[:2]
            if namespace == "_c10d_functional" and op != "wait_tensor":
                self.record(op, tensors, dist.distributed_c10d._resolve_process_group(args[-1]))
        if name in _HOST_READS and tensors and self.on_fake(tensors[0]):
            self.host_syncs.append((name, _origin()))
        target = self._requested_device(func, args, kwargs)
        if target is None:
            out = func(*args, **kwargs)
            if any(self.on_fake(t) for t in tensors):
                if any(not self.on_fake(t) and t.dim() > 0 for t in tensors) and name not in ("copy_", "__setitem__"):
                    self.mixed.append((name, _origin()))
                self._mark(out)
            return out
        if func is torch.Tensor.cuda or func is torch.Tensor.cpu:
            out = args[0] if (func is torch.Tensor.cuda) == self.on_fake(args[0]) else args[0].to(_CPU, copy=True)
        else:
            if func is torch.Tensor.to:
                args = tuple(_CPU if _is_fake(a) else a for a in args)
            if "device" in kwargs:
                kwargs["device"] = _CPU
            if func is torch.Tensor.to and self.on_fake(args[0]) != _is_fake(target):
                kwargs["copy"] = True   # another device: a new tensor, as a real copy would be
            out = func(*args, **kwargs)
        if _is_fake(target):
            # A copy from pageable host memory to the GPU (torch.tensor(data, device=...), .to/.cuda of
            # a CPU tensor) waits for the stream: a host sync.
            from_host = func is torch.tensor or (func in (torch.Tensor.to, torch.Tensor.cuda) and not self.on_fake(args[0])
                                                 and not kwargs.get("non_blocking", False))
            if from_host:
                self.host_syncs.append((f"host-to-device {name}", _origin()))
            self._mark(out)
        return out

    def _requested_device(self, func, args, kwargs):
        if func is torch.Tensor.cuda:
            return FAKE
        if func is torch.Tensor.cpu:
            return _CPU
        if kwargs.get("device") is not None:
            return torch.device(kwargs["device"]) if not isinstance(kwargs["device"], int) else FAKE
        if func is torch.Tensor.to:
            for a in args[1:]:
                if isinstance(a, (str, torch.device)):
                    return torch.device(a)
                if isinstance(a, torch.Tensor):
                    return self.device_of(a)
        return None

    # -- collectives ------------------------------------------------------------------------------
    def record(self, name: str, tensors: list[torch.Tensor], group) -> None:
        from graphzero.devices import collective_device
        self.calls.append(Call(name, [self.device_of(t) for t in tensors], collective_device(group), _origin()))

    def wrap_collective(self, fn, name: str):
        def recorded(*args, **kwargs):
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            self.record(name, tensors, kwargs.get("group"))
            return fn(*args, **kwargs)
        return recorded

    def graphzero_calls(self) -> list[Call]:
        return [c for c in self.calls if c.origin is not None]


def engine_tensors(*engines) -> list[torch.Tensor]:
    """What a GPU run keeps on the GPU: each engine's parameters (and ZeRO-3 shards), buffers,
    and every tensor its ZeRO optimizer and base optimizer hold."""
    found: dict[int, torch.Tensor] = {}

    def walk(obj, depth: int) -> None:
        if isinstance(obj, torch.Tensor):
            found.setdefault(id(obj), obj)
            if hasattr(obj, "ds_tensor"):
                walk(obj.ds_tensor, depth)
        elif depth > 0 and isinstance(obj, (list, tuple, set)):
            for x in obj:
                walk(x, depth - 1)
        elif depth > 0 and isinstance(obj, dict):
            for x in obj.values():
                walk(x, depth - 1)
    for eng in engines:
        walk(list(eng.module.parameters()) + list(eng.module.buffers()), 2)
        walk(dict(vars(eng.optimizer)), 4)
        walk(dict(eng.optimizer.optimizer.state), 3)
    return list(found.values())


@contextlib.contextmanager
def reported_as_nccl(*engines):
    """Within: every process group reports the NCCL backend, this rank's current CUDA device is 0,
    the engines and DeepSpeed's accelerator say cuda:0, and tensors can live on a FakeCuda cuda:0."""
    from deepspeed.accelerator import get_accelerator

    from graphzero import shard_gather

    mode = FakeCuda(engine_tensors(*engines))
    acc = get_accelerator()
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(dist, "get_backend", lambda group=None: "nccl"))
        stack.enter_context(mock.patch.object(torch.cuda, "current_device", lambda: 0))
        stack.enter_context(mock.patch.object(acc, "current_device_name", lambda: "cuda:0"))
        stack.enter_context(mock.patch.object(acc, "device_name", lambda index=None: "cuda:0"))
        for name in _COLLECTIVES:
            stack.enter_context(mock.patch.object(dist, name, mode.wrap_collective(getattr(dist, name), name)))
        for eng in engines:
            stack.enter_context(mock.patch.object(eng, "device", FAKE))
        # The autograd engine (C++) hands graphzero's autograd.Function its output's gradient without
        # passing through the mode: on a GPU it is where the forward's output was, on cuda:0.
        gather_backward = shard_gather._GatherShard.backward

        def backward(ctx, grad):
            mode._mark(grad)
            return gather_backward(ctx, grad)
        stack.enter_context(mock.patch.object(shard_gather._GatherShard, "backward", staticmethod(backward)))
        stack.enter_context(mode)
        yield mode
