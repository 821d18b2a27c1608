"""Opacus, imported once with the root logger left as it was.

One of Opacus' modules calls ``logging.basicConfig`` when it is imported, which gives a program
that has not configured logging yet a stderr handler it did not ask for (and turns its own later
``basicConfig`` into a no-op). Every use of Opacus in this project imports it from here, which
takes that handler off again; whatever the program itself had installed stays.
"""

from __future__ import annotations

import logging

_root = logging.getLogger()
_before = list(_root.handlers)
try:
    from opacus import GradSampleModule
    from opacus.accountants import PRVAccountant, RDPAccountant
    from opacus.accountants.analysis import rdp as rdp_analysis
    from opacus.accountants.utils import get_noise_multiplier
    from opacus.optimizers import DPOptimizer
    from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed
finally:
    for _handler in [h for h in _root.handlers if h not in _before]:
        _root.removeHandler(_handler)

__all__ = [
    "DPOptimizer",
    "GradSampleModule",
    "PRVAccountant",
    "RDPAccountant",
    "_check_processed_flag",
    "_mark_as_processed",
    "get_noise_multiplier",
    "rdp_analysis",
]
