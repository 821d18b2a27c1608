"""secure-vfl: privacy-hardened vertical federated learning.

The core (this package) says what vertical federated learning computes: data, partitions,
missingness, models, methods and the party-boundary seam they talk through. The privacy layer
(``protocols``) and the attack suite (``attacks``) plug into that seam.
"""

__version__ = "0.1.0"
