"""A record of every change graphzero makes to a DeepSpeed engine, its optimizer, its module and
its parameters, undone in reverse order on ``detach`` and on a failed ``attach``.

Each change goes through one `PatchLedger` method that remembers what was there first. The ledger
never guesses: an attribute that does not land in ``obj.__dict__`` when set (an ``nn.Module``
parameter or submodule name) is refused, since undoing it would need another rule.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

_ABSENT = object()


def _class_data_descriptor(obj: object, name: str) -> bool:
    for klass in type(obj).__mro__:
        if name in vars(klass):
            return hasattr(vars(klass)[name], "__set__")
    return False


def _reorder(d: dict, order: list) -> None:
    """Put ``d``'s keys back in ``order`` (keys not in it keep their relative order, after)."""
    rank = {k: i for i, k in enumerate(order)}
    keys = list(d)
    wanted = sorted(keys, key=lambda k: rank.get(k, len(order)))
    if wanted != keys:
        items = [(k, d[k]) for k in wanted]
        d.clear()
        d.update(items)


class PatchLedger:
    """The changes made to one engine; ``undo()`` reverts them all."""

    def __init__(self, owner: str = "") -> None:
        self.owner = owner
        self._undo: list[tuple[str, Callable[[], None]]] = []

    def __len__(self) -> int:
        return len(self._undo)

    def __repr__(self) -> str:
        return f"PatchLedger({self.owner!r}, {len(self)} changes)"

    def entries(self) -> list[str]:
        """What each recorded change was, oldest first."""
        return [what for what, _ in self._undo]

    def set_attr(self, obj: object, name: str, value: Any) -> None:
        """``setattr(obj, name, value)``, remembering what was there (through a class data descriptor)."""
        what = f"{type(obj).__name__}.{name}"
        if _class_data_descriptor(obj, name):
            old = getattr(obj, name)
            setattr(obj, name, value)
            self._undo.append((f"set {what} (descriptor)", lambda: setattr(obj, name, old)))
            return
        d = vars(obj)
        old = d.get(name, _ABSENT)
        setattr(obj, name, value)
        if d.get(name, _ABSENT) is not value:
            self._restore(d, name, old)
            raise TypeError(f"PatchLedger.set_attr: {what} did not become an instance attribute")
        self._undo.append((f"set {what}", lambda: self._restore(d, name, old)))

    def pop_attr(self, obj: object, name: str) -> Any:
        """Remove the instance attribute ``name`` (if there is one); returns it (or None)."""
        d = vars(obj)
        if name not in d:
            return None
        old = d.pop(name)
        self._undo.append((f"pop {type(obj).__name__}.{name}", lambda: self._restore(d, name, old)))
        return old

    @staticmethod
    def _restore(d: dict, name: str, old: object) -> None:
        if old is _ABSENT:
            d.pop(name, None)
        else:
            d[name] = old

    def remove_hook(self, handle) -> None:
        """Remove someone else's hook by its handle; undo puts it back under the same id at the same
        position, so the handle its owner keeps still removes it."""
        refs = (handle.hooks_dict_ref, *handle.extra_dict_ref)
        saved = [(d, list(d), d[handle.id]) for d in (r() for r in refs) if d is not None and handle.id in d]
        handle.remove()

        def put_back() -> None:
            for d, order, value in saved:
                d[handle.id] = value
                _reorder(d, order)

        self._undo.append((f"remove hook {handle.id}", put_back))

    def add_hook(self, handle):
        """A hook graphzero registered: removed on undo. Returns the handle."""
        self._undo.append((f"add hook {handle.id}", handle.remove))
        return handle

    def post_accumulate_grad_hook(self, tensor, fn):
        """Register ``fn``; undo removes it and restores a hook dict that was None."""
        had = tensor._post_accumulate_grad_hooks
        handle = tensor.register_post_accumulate_grad_hook(fn)

        def remove() -> None:
            handle.remove()
            if had is None and not tensor._post_accumulate_grad_hooks:
                tensor._post_accumulate_grad_hooks = None

        self._undo.append((f"add post-accumulate-grad hook {handle.id}", remove))
        return handle

    def clear_list(self, lst: list) -> None:
        """Empty ``lst`` in place; undo refills the same list object with the same items."""
        saved = list(lst)
        lst.clear()
        self._undo.append(("clear list", lambda: lst.__setitem__(slice(None), saved)))

    def on_undo(self, fn: Callable[[], None], what: str = "") -> None:
        """Run ``fn`` on undo, in reverse order with everything else."""
        self._undo.append((what or getattr(fn, "__qualname__", repr(fn)), fn))

    def undo(self) -> None:
        """Revert every change, newest first; all steps run, then the first failure is raised."""
        errors: list[tuple[str, BaseException]] = []
        while self._undo:
            what, fn = self._undo.pop()
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - keep undoing; reported below
                errors.append((what, exc))
        if errors:
            what, first = errors[0]
            for other_what, other in errors[1:]:
                first.add_note(f"also failed while undoing {self.owner!r}: {other_what}: {other!r}")
            first.add_note(f"while undoing {self.owner!r}: {what}")
            raise first
