"""The run time of an engine's gradient, between the compiled backward and ``engine.step()``.

- `EngineState` (state.py): one per attached engine, the only owner of what changes while
  training: its partial sums (partial.py), folded norm (norm.py), pending-forward counts and
  whether it received a gradient; the adapter implements `EngineBinding` for it.
- `BackwardScope` (scope.py): one per autograd backward; ends every engine it reached.
- `Backward` / `GraphBackward` / `CountForwards` (backward.py): the compiled graphs as called at
  run time: variant dispatch, run-time inputs, forward counts.
"""
from .backward import Backward, CountForwards, GraphBackward, Modes, label
from .norm import FoldedNorm
from .partial import PartialSums
from .scope import BackwardScope
from .state import EngineBinding, EngineState, GraphCall

__all__ = ["Backward", "BackwardScope", "CountForwards", "EngineBinding", "EngineState", "FoldedNorm",
           "GraphBackward", "GraphCall", "Modes", "PartialSums", "label"]
