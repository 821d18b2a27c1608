"""Configuration objects built in Python refuse values of the wrong type on construction, naming
the field, what was expected and what was found; numpy numbers are taken and stored as Python's
own, so that a configuration writes as JSON."""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from attacks.runner import parse_defenses
from protocols.privacy import PrivacyEngine, PrivacySpec
from secure_vfl import checks
from secure_vfl.errors import ConfigError
from secure_vfl.experiment import ImputeRunConfig, TrainConfig
from secure_vfl.methods import MethodConfig
from secure_vfl.methods.false_vfl import FalseVflConfig
from secure_vfl.methods.imputation import ImputeConfig


def _train(**fields: Any) -> TrainConfig:
    return TrainConfig(**{"method": "laser", "dataset": "wine", **fields})


WRONG: list[tuple[Any, dict[str, Any], str]] = [
    (
        MethodConfig,
        {"lr": "0.1"},
        "`lr` must be a positive number, at most 3.40282e+38 (float32's largest). Found '0.1'.",
    ),
    (
        MethodConfig,
        {"lr": True},
        "`lr` must be a positive number, at most 3.40282e+38 (float32's largest). Found True.",
    ),
    (MethodConfig, {"momentum": None}, "`momentum` must be in [0, 1). Found NoneType."),
    (
        MethodConfig,
        {"weight_decay": np.inf},
        "`weight_decay` must be a number >= 0, at most 3.40282e+38 (float32's largest). Found inf.",
    ),
    (MethodConfig, {"secure_sums": "no"}, "`secure_sums` must be True or False. Found 'no'."),
    (MethodConfig, {"vectorised": 1}, "`vectorised` must be True or False. Found 1."),
    (MethodConfig, {"epochs": 2.0}, "`epochs` must be a positive integer. Found 2.0."),
    (FalseVflConfig, {"train_lr": "1"}, "`train_lr` must be a positive number. Found '1'."),
    (ImputeConfig, {"client_fraction": 0}, "`client_fraction` must be in (0, 1]. Found 0.0."),
    (_train, {"parties": 4.0}, "`parties` must be an integer. Found 4.0."),
    (_train, {"parties": "4"}, "`parties` must be an integer. Found '4'."),
    (_train, {"dataset": 5}, "`dataset` must be a str. Found 5."),
    (_train, {"method": ["laser"]}, "`method` must be a str. Found list."),
    (_train, {"method_config": {"epochs": 1}}, "`method_config` must be a MethodConfig. Found"),
    (_train, {"train_missing": 0.5}, "`train_missing` must be a str. Found 0.5."),
    (_train, {"test_missing": "mcar:0"}, "`test_missing` must be a tuple of str. Found 'mcar"),
    (_train, {"id_column": "x"}, "`id_column` applies to party files (a registered dataset"),
    # accepted, then an overflow deep in the run (the command line refused it)
    (
        _train,
        {"seed": 2**70},
        "`seed` must be an integer seed in [0, 2**32). Found 1180591620717411303424.",
    ),
    (
        ImputeRunConfig,
        {"method": "mean", "dataset": "ozone", "seed": 2**32},
        "`seed` must be an integer seed in [0, 2**32). Found 4294967296.",
    ),
    (
        ImputeRunConfig,
        {"method": "mean", "dataset": "ozone", "label_column": "y"},
        "`id_column` and `label_column` apply to client files (a registered dataset",
    ),
    (
        TrainConfig,
        {"method": "laser", "party_files": "a.csv", "label_file": "l.csv"},
        "`party_files` must be a tuple of paths. Found str.",
    ),
    (
        ImputeRunConfig,
        {"method": "mean", "dataset": "ozone", "impute_config": {"rounds": 1}},
        "`impute_config` must be an ImputeConfig. Found dict.",
    ),
    (
        ImputeRunConfig,
        {"method": "mean", "dataset": "ozone", "availability": "0.5"},
        "`availability` must be in (0, 1]. Found '0.5'.",
    ),
    (
        ImputeRunConfig,
        {"method": "mean", "dataset": "ozone", "id_column": "x", "label_column": "x"},
        "the id and label columns must differ. Found both 'x'.",
    ),
    (
        ImputeRunConfig,
        {"method": "mean", "dataset": "ozone", "id_column": ""},
        "`id_column` must be a column name. Found ''.",
    ),
    # each of these crashed in the run (TypeError, KeyError, torch's "Overflow when unpacking")
    (FalseVflConfig, {"latent_dim": None}, "`latent_dim` must be a positive integer. Found None"),
    (FalseVflConfig, {"kappa": None}, "`kappa` must be a positive integer. Found NoneType."),
    (FalseVflConfig, {"hidden": 10**30}, "`hidden` must be at most 65536. Found 10000"),
    (ImputeConfig, {"hidden": 10**30}, "`hidden` must be at most 65536. Found 10000"),
    (ImputeConfig, {"layers": 65}, "`layers` must be at most 64. Found 65."),  # was ignored
    # beyond the features it only padded the graph: (batch, features, top_k, hidden) in memory
    (ImputeConfig, {"top_k": 10**6}, "`top_k` must be at most 4096. Found 1000000."),
    (
        PrivacySpec,
        {"seed": 2**32},
        "`seed` must be an integer seed in [0, 2**32). Found 4294967296",
    ),
    (PrivacySpec, {"dp_embeddings": "1:1"}, "`dp_embeddings` must be a (SIGMA, CLIP) pair"),
    (PrivacySpec, {"dp_sgd": ("1", "1")}, "`dp_sgd` must be a (SIGMA, CLIP) pair of numbers."),
    (PrivacySpec, {"delta": "1e-5"}, "`delta` must be in (0, 1). Found '1e-5'."),
    (
        PrivacySpec,
        {"dp_gradients": (1.0, 0.1), "target_epsilon": -1.0},
        "`target_epsilon` must be a positive number. Found -1.0.",
    ),
    (PrivacyEngine, {"spec": {"secure_agg": "masks"}}, "`spec` must be a PrivacySpec. Found dict."),
    (
        parse_defenses,
        {"texts": "marvell:4", "spec": PrivacySpec()},
        "`defenses` must be a tuple of str.",
    ),
]


@pytest.mark.parametrize(("make", "fields", "expected"), WRONG)
def test_a_value_of_the_wrong_type_is_refused_naming_the_field(
    make: Any, fields: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(expected)):
        make(**fields)


def test_numpy_numbers_are_taken_and_stored_as_pythons_own() -> None:
    config = _train(
        seed=np.int64(3),
        parties=np.int64(3),
        method_config=MethodConfig(epochs=np.int64(2), lr=np.float32(0.5), batch_size=np.int32(8)),
    )
    assert (config.seed, config.parties) == (3, 3) and type(config.seed) is int
    assert type(config.method_config.epochs) is int and type(config.method_config.lr) is float
    json.dumps(config.to_json())  # numpy's numbers would not write
    spec = PrivacySpec(dp_gradients=(np.float32(1.0), 0.1), seed=np.int64(2))
    assert json.dumps(asdict(spec)) and type(spec.dp_gradients[0]) is float  # type: ignore[index]
    impute = ImputeRunConfig(method="mean", dataset="ozone", clients=np.int64(3))
    assert type(impute.clients) is int
    paths = TrainConfig(method="laser", party_files=["a.csv", Path("b.csv")], label_file="l.csv")
    assert paths.party_files == (Path("a.csv"), Path("b.csv")) and paths.label_file == Path("l.csv")


def test_the_checks_take_what_they_promise_and_no_more() -> None:
    assert checks.integer("n", np.uint8(3), low=1) == 3
    assert checks.real("x", 1, low=0, high=1) == 1.0
    for wrong in (True, np.bool_(True), "1", None, 1.5):
        with pytest.raises(ConfigError, match="`n` must be an integer"):
            checks.integer("n", wrong)
    for wrong in (float("nan"), 1.0):
        with pytest.raises(ConfigError, match=re.escape("`x` must be in [0, 1)")):
            checks.real("x", wrong, low=0, high=1, high_open=True)
    assert checks.flag("f", np.bool_(False)) is False
    assert checks.texts("t", ["a", "b"]) == ("a", "b")


def test_the_entry_points_refuse_arguments_of_the_wrong_kind_naming_them() -> None:
    """A PrivacySpec passed where its engine goes, a dict for a config, data or a task: an
    AttributeError from deep inside the run before."""
    from attacks.suite import run_suite
    from secure_vfl.experiment import (
        imputed_tables,
        prepare_data,
        prepare_imputation_task,
        run_imputation,
        run_training,
    )
    from secure_vfl.saved_model import SavedModel

    config, impute = _train(), ImputeRunConfig(method="mean", dataset="ozone", clients=3)
    engine = re.escape("(protocols.privacy.PrivacyEngine(spec), not the spec itself)")
    for call, refusal in (
        (
            lambda: run_training(config, privacy=PrivacySpec()),
            f"`privacy` must be a Priv.*{engine}",
        ),
        (lambda: run_training({"method": "laser"}), "`config` must be a TrainConfig. Found dict"),
        (lambda: run_training(config, data={"x": 1}), r"`data` must be a VerticalData \(prepare"),
        (lambda: run_imputation(impute, privacy=PrivacySpec()), f"must be an Imput.*{engine}"),
        (lambda: run_imputation(impute, task={"a": 1}), "`task` must be an ImputationTask"),
        # an AttributeError or TypeError before, or (run_suite) the letters taken as names
        (lambda: prepare_data({"method": "laser"}), "`config` must be a TrainConfig. Found dict"),
        (lambda: prepare_imputation_task({}), "`config` must be an ImputeRunConfig. Found dict"),
        (lambda: imputed_tables(None, None), "`task` must be an ImputationTask"),  # type: ignore[arg-type]
        (lambda: SavedModel.load(None), "`path` must be a path to a run directory"),  # type: ignore[arg-type]
        (lambda: run_suite(config, attacks="norm-scoring"), "`attacks` must be a list of names"),
    ):
        with pytest.raises(ConfigError, match=refusal):
            call()
    # A task dealt to 3 clients under a config of 5 recorded 5 clients in its result.
    task = prepare_imputation_task(impute)
    with pytest.raises(ConfigError, match="clients=5 expected, found a task of 3 clients"):
        run_imputation(ImputeRunConfig(method="mean", dataset="ozone", clients=5), task=task)
    assert run_imputation(impute, task=task)[0].config["clients"] == 3


def test_a_missingness_refusal_names_its_field() -> None:
    with pytest.raises(ConfigError, match=r"`train_missing` 'mcar:1': `p` must be in \[0, 1\)"):
        _train(train_missing="mcar:1")
    with pytest.raises(ConfigError, match="`test_missing` 'mnar:2': "):
        _train(test_missing=("mcar:0", "mnar:2"))


def test_the_command_lines_seed_range_is_the_configs() -> None:
    from secure_vfl import checks, cli

    assert cli.SEED_LIMIT == checks.SEED_LIMIT


def test_a_config_of_party_files_has_one_party_per_file() -> None:
    """`TrainConfig(parties=7)` of 3 files ran 3 parties and recorded 7 (the default, 4, too)."""
    files: dict[str, Any] = {
        "party_files": (Path("a.csv"), Path("b.csv"), Path("c.csv")),
        "label_file": Path("l.csv"),
    }
    assert TrainConfig(method="laser", **files).parties == 3
    assert TrainConfig(method="laser", parties=3, **files).parties == 3
    with pytest.raises(ConfigError, match=r"`parties` 7 contradicts the 3 party files"):
        TrainConfig(method="laser", parties=7, **files)


def test_every_config_object_is_exported_beside_method_config() -> None:
    """`from secure_vfl.methods import FalseVflConfig` failed (the README lists it there)."""
    from secure_vfl import methods

    assert methods.FalseVflConfig is FalseVflConfig and methods.MethodConfig is MethodConfig


def test_a_registered_datasets_data_is_refused_under_a_config_of_another() -> None:
    """An iris config trained on wine's data, and its result said iris."""
    from secure_vfl.experiment import check_data, prepare_data

    wine = TrainConfig(method="laser", dataset="wine", parties=2)
    data = prepare_data(wine)
    check_data(wine, data)
    with pytest.raises(ConfigError, match="dataset iris expected, found wine"):
        check_data(TrainConfig(method="laser", dataset="iris", parties=2), data)
