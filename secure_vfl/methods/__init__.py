"""Learning methods. Importing this package registers every method in :data:`METHODS`."""

from secure_vfl.methods import baselines, false_vfl, laser
from secure_vfl.methods.base import METHODS, PARTY_MODELS, Method, MethodConfig

__all__ = ["METHODS", "PARTY_MODELS", "Method", "MethodConfig", "baselines", "false_vfl", "laser"]
