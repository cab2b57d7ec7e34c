"""Conditional execution: branches and loops chosen on the device, and their emulations for HIP."""

from __future__ import annotations

from .graph import ConditionalGraph, ConditionalState
from .loop import DeviceWhileLoop, LoopCondition
from .ops import conditional_select
from .strategies import BranchStrategy, register_strategy, strategy_names
from .support import ConditionalSupport, conditional_support

__all__ = ["ConditionalGraph", "ConditionalState", "DeviceWhileLoop", "LoopCondition", "conditional_select",
           "ConditionalSupport", "conditional_support", "BranchStrategy", "register_strategy", "strategy_names"]
