"""Federated imputation under heterogeneous feature schemas: FedHF-Impute and its baselines.

Importing this package registers every imputer in :data:`IMPUTERS` (``fedhf``, ``mean``, ``knn``,
``mice``, ``dae``, ``fed-mean``, ``fed-dae``).
"""

from secure_vfl.methods.imputation import baselines, fedhf
from secure_vfl.methods.imputation.base import (
    IMPUTERS,
    ImputeConfig,
    Imputer,
    ImputerFactory,
    imputation_rule,
)
from secure_vfl.methods.imputation.evaluation import ImputationScores, evaluate, hidden_test_entries
from secure_vfl.methods.imputation.fedhf import (
    ReconstructionImputer,
    block_mask,
    federated_average,
    masked_mse,
)
from secure_vfl.methods.imputation.statistics import (
    SERVER,
    FeatureRanges,
    FederatedStatistics,
    Standardisation,
    StatisticsPrivacy,
    federated_statistics,
    wide_sum,
)

__all__ = [
    "IMPUTERS",
    "SERVER",
    "FeatureRanges",
    "FederatedStatistics",
    "ImputationScores",
    "ImputeConfig",
    "Imputer",
    "ImputerFactory",
    "ReconstructionImputer",
    "Standardisation",
    "StatisticsPrivacy",
    "baselines",
    "block_mask",
    "evaluate",
    "federated_average",
    "federated_statistics",
    "fedhf",
    "hidden_test_entries",
    "imputation_rule",
    "masked_mse",
    "wide_sum",
]
