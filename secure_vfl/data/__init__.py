"""Datasets, vertical partitions, missingness mechanisms, availability masks and batch samplers.

The offline dataset registry (:data:`DATASETS`), loaders for the papers' original files, the
user's own per-party files, and :func:`make_vertical` / :func:`vertical_from_party_files`, the
pipeline every method trains on.
"""

from secure_vfl.data.datasets import (
    DATASETS,
    DatasetSpec,
    DatasetSplit,
    Kind,
    LabeledArrays,
    data_home,
    dataset_status,
    install_all,
    install_dataset,
    load_dataset,
)
from secure_vfl.data.missingness import (
    Mechanism,
    beta_rates,
    dirichlet_rates,
    drop_unobserved,
    mar1,
    mar2,
    mcar,
    mnar_mean_sign,
    parse_mechanism,
)
from secure_vfl.data.originals import load_cifar, load_credit_default, load_hapt
from secure_vfl.data.partition import column_blocks, image_grid, image_patches, partition
from secure_vfl.data.party_files import LabelTable, PartyTable, read_label_file, read_party_file
from secure_vfl.data.preprocessing import Standardizer, stratified_split
from secure_vfl.data.samplers import (
    BatchSampler,
    GroupedSampler,
    MixedSampler,
    SamplerKind,
    make_sampler,
)
from secure_vfl.data.vertical import (
    VerticalData,
    VerticalSplit,
    make_vertical,
    vertical_from_party_files,
)

__all__ = [
    "DATASETS",
    "BatchSampler",
    "DatasetSpec",
    "DatasetSplit",
    "GroupedSampler",
    "Kind",
    "LabelTable",
    "LabeledArrays",
    "Mechanism",
    "MixedSampler",
    "PartyTable",
    "SamplerKind",
    "Standardizer",
    "VerticalData",
    "VerticalSplit",
    "beta_rates",
    "column_blocks",
    "data_home",
    "dataset_status",
    "dirichlet_rates",
    "drop_unobserved",
    "image_grid",
    "image_patches",
    "install_all",
    "install_dataset",
    "load_cifar",
    "load_credit_default",
    "load_dataset",
    "load_hapt",
    "make_sampler",
    "make_vertical",
    "mar1",
    "mar2",
    "mcar",
    "mnar_mean_sign",
    "parse_mechanism",
    "partition",
    "read_label_file",
    "read_party_file",
    "stratified_split",
    "vertical_from_party_files",
]
