"""The privacy layer: PSI, secure aggregation, Paillier/CKKS backends, differential privacy and TLS.

Each module implements one of the core's seam interfaces (``secure_vfl.federation``); none forks a
core algorithm. Nothing is implemented here yet: see the project's open issues.
"""
