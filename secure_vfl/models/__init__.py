"""Bottom (representation) models and fusion heads."""

from secure_vfl.models.networks import (
    ConcatHead,
    ConvBottom,
    LinearHead,
    MLPBottom,
    make_bottom,
    parameter_count,
)

__all__ = ["ConcatHead", "ConvBottom", "LinearHead", "MLPBottom", "make_bottom", "parameter_count"]
