"""Learning methods. Importing this package registers every method in :data:`METHODS`."""

from secure_vfl.methods import baselines, laser
from secure_vfl.methods.base import METHODS, Method, MethodConfig

__all__ = ["METHODS", "Method", "MethodConfig", "baselines", "laser"]
