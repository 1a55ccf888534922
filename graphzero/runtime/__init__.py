"""The run time of an engine's gradient, between the compiled backward and ``engine.step()``:
`EngineState` (state.py, one per attached engine: partial sums, folded norm, forward counts),
`BackwardScope` (scope.py, one per autograd backward) and the compiled graphs as called at run
time (backward.py).
"""
from .backward import Backward, CountForwards, ForwardWithAgreement, GraphBackward, Modes, label
from .norm import FoldedNorm
from .partial import PartialSums
from .scope import BackwardScope
from .state import EngineBinding, EngineState, GraphCall

__all__ = ["Backward", "BackwardScope", "CountForwards", "EngineBinding", "EngineState", "FoldedNorm",
           "ForwardWithAgreement", "GraphBackward", "GraphCall", "Modes", "PartialSums", "label"]
