"""Learning methods. Importing this package registers every method in :data:`METHODS`."""

from secure_vfl.methods import baselines, false_vfl, laser
from secure_vfl.methods.base import METHODS, PARTY_MODELS, Method, MethodConfig
from secure_vfl.methods.false_vfl import FalseVflConfig

ONE_HEAD_METHODS = ("standard", "plugvfl", "false-vfl-1", "false-vfl-2")
"""The methods whose only head is the label party's, whatever ``MethodConfig.heads`` says."""

EVERY_HEAD_METHODS = ("local", "ensemble", "combinatorial")
"""The methods that train a head at every party: ``MethodConfig.heads`` must be ``"all"``."""

__all__ = [
    "EVERY_HEAD_METHODS",
    "METHODS",
    "ONE_HEAD_METHODS",
    "PARTY_MODELS",
    "FalseVflConfig",
    "Method",
    "MethodConfig",
    "baselines",
    "false_vfl",
    "laser",
]
