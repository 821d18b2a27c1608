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
from secure_vfl.methods.imputation.clients import ImputationClient, block_mask, masked_mse
from secure_vfl.methods.imputation.evaluation import ImputationScores, evaluate, hidden_test_entries
from secure_vfl.methods.imputation.federation import (
    Coordinator,
    ImputationFederation,
    build_imputation_federation,
    federated_statistics,
    in_process_clients,
)
from secure_vfl.methods.imputation.fedhf import ReconstructionImputer
from secure_vfl.methods.imputation.statistics import (
    SERVER,
    FeatureRanges,
    FederatedStatistics,
    ReleaseTerms,
    Standardisation,
    StatisticsPrivacy,
    StatisticsPrivacyFactory,
)

__all__ = [
    "IMPUTERS",
    "SERVER",
    "Coordinator",
    "FeatureRanges",
    "FederatedStatistics",
    "ImputationClient",
    "ImputationFederation",
    "ImputationScores",
    "ImputeConfig",
    "Imputer",
    "ImputerFactory",
    "ReconstructionImputer",
    "ReleaseTerms",
    "Standardisation",
    "StatisticsPrivacy",
    "StatisticsPrivacyFactory",
    "baselines",
    "block_mask",
    "build_imputation_federation",
    "evaluate",
    "federated_statistics",
    "fedhf",
    "hidden_test_entries",
    "imputation_rule",
    "in_process_clients",
    "masked_mse",
]
