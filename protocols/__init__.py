"""The privacy layer: each module implements one of the core's seam interfaces.

- :mod:`protocols.psi`: Diffie-Hellman PSI over X25519 and a PSI-backed ``Aligner``.
- :mod:`protocols.psi_kernel`: PSI's torch-free arithmetic (hashing ids to X25519 points,
  scalar multiplication in worker processes, digests), so a worker need not import torch.
- :mod:`protocols.secagg`: pairwise-mask secure aggregation, a ``SealingScheme``.
- :mod:`protocols.paillier`: Paillier secure sums (``phe``), a ``SealingScheme``.
- :mod:`protocols.ckks`: CKKS secure sums under the receiver's key (``tenseal``), a
  ``SealingScheme``.
- :mod:`protocols.dp`: Gaussian noise as channel layers, DP-SGD with Opacus, the accountant.

None forks a core algorithm; the core (``secure_vfl``) never imports this package, only the
command line (the composition root) does.
"""
