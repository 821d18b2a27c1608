"""FALSE-VFL's set-up in a deployment, without processes: what the label party tells each data
party, and the party that builds itself from it (the process tests are in test_deploy.py)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from test_deploy import PARTIES, write_federation, write_party_files

from secure_vfl.data.party_files import PartyTable, read_party_file
from secure_vfl.deployment import (
    _deployment,
    build_served_party,
    join_alignment,
    label_side,
    setup_bodies,
)
from secure_vfl.errors import ProtocolError
from secure_vfl.experiment import TrainConfig, build_method, prepare_data
from secure_vfl.federation.federation_file import Federation, read_federation
from secure_vfl.federation.network import free_loopback_ports
from secure_vfl.methods import MethodConfig
from secure_vfl.methods.base import in_process_parties
from secure_vfl.methods.false_vfl import FalseVflConfig, LatentParty

OPTIONS = FalseVflConfig(latent_dim=6, global_latent_dim=3, hidden=32, kappa=3)


def _site(directory: Path) -> tuple[Federation, dict[str, PartyTable]]:
    """The parties' files and federation file in ``directory``, and every party's table."""
    write_party_files(directory)
    federation = read_federation(
        write_federation(directory, directory / "certs", free_loopback_ports(5))
    )
    return federation, {name: read_party_file(directory / f"{name}.csv") for name in PARTIES}


def _laser(directory: Path, **settings: Any) -> TrainConfig:
    """A one-epoch LASER run of the parties' files in ``directory``."""
    return TrainConfig(
        method="laser",
        party_files=tuple(directory / f"{name}.csv" for name in PARTIES),
        label_file=directory / "labels.csv",
        method_config=MethodConfig(epochs=1),
        **settings,
    )


def _label_side(
    config: TrainConfig,
    federation: Federation,
    tables: dict[str, PartyTable],
    ids: list[Any] | None = None,
) -> Any:
    """The label party's side of a plain-join set-up (``ids``: the data parties' ids it was
    told, by default their tables')."""
    others = [tables[name] for name in PARTIES[1:]]
    return label_side(
        config,
        federation,
        tables["bank"],
        join_alignment(tables["bank"], ids if ids is not None else [t.ids for t in others]),
        [len(t.columns) for t in others],
    )


def test_a_false_vfl_party_builds_itself_as_in_one_process_and_is_given_no_label(
    tmp_path: Path,
) -> None:
    federation, tables = _site(tmp_path)
    config = TrainConfig(
        method="false-vfl-2",
        party_files=tuple(tmp_path / f"{name}.csv" for name in PARTIES),
        label_file=tmp_path / "labels.csv",
        method_config=MethodConfig(epochs=1, batch_size=64, labeled=100),
        false_vfl=OPTIONS,
        seed=5,
    )
    side = _label_side(config, federation, tables)
    bodies = setup_bodies(config, side, federation, "none")
    assert side.data.train.n > 100  # some training rows are unlabelled
    for name in PARTIES[1:]:
        assert bodies[name]["labels"] is None  # only the label party holds labels
        assert bodies[name]["false_vfl"] == dataclasses.asdict(OPTIONS)
    alone = in_process_parties(build_method(config, prepare_data(config)).fed.channel)
    for k, name in enumerate(PARTIES[1:], start=1):
        setup = _deployment("bank", name, "setup", bodies[name])
        served = build_served_party(name, setup, tables[name], lambda scheme: None)
        party = alone[k]
        assert isinstance(served, LatentParty) and isinstance(party, LatentParty)
        assert served.latent_model.missingness is not None  # FALSE-VFL-II's
        expected = party.latent_model.state_dict()
        for key, value in served.latent_model.state_dict().items():
            assert torch.equal(value, expected[key]), (name, key)
        for split, block in party._blocks.items():
            assert torch.equal(served._blocks[split], block), (name, split)
            assert torch.equal(served._observed[split], party._observed[split])
        assert torch.equal(served.generator.get_state(), party.generator.get_state())
    # A set-up that hands a FALSE-VFL party labels, or bad options, is refused.
    wrong: dict[str, dict[str, Any]] = {
        "holds no label": {"labels": [0] * len(bodies["shop"]["rows"]["train"])},
        "valid `false_vfl` options": {"false_vfl": {"kappa": 0}},
        # What a label party may ask a data party to build is bounded.
        "`hidden` of at most 4096 expected": {"false_vfl": {"hidden": 10**6}},
        "`representation_dim` of at most 4096 expected": {
            "method_config": {**bodies["shop"]["method_config"], "representation_dim": 10**6}
        },
        "`num_classes` of at most 4096 expected": {"num_classes": 10**9},
    }
    for expected_error, change in wrong.items():
        setup = _deployment("bank", "shop", "setup", {**bodies["shop"], **change})
        with pytest.raises(ProtocolError, match=expected_error):
            build_served_party("shop", setup, tables["shop"], lambda scheme: None)


def test_a_party_whose_ids_match_no_label_is_named_by_its_name(tmp_path: Path) -> None:
    """The deployed label party said "no ids of party 1 matched the label file"."""
    from secure_vfl.errors import DataError

    federation, tables = _site(tmp_path)
    config = _laser(tmp_path)
    others = [tables[name] for name in PARTIES[1:]]
    ids = [t.ids for t in others]
    ids[0] = ids[0].astype(object) + "-elsewhere"  # shop's ids, in another format
    with pytest.raises(DataError, match=f"^no ids of {PARTIES[1]} matched the label file "):
        _label_side(config, federation, tables, ids)


def test_each_party_applies_the_runs_missing_cells_policy_to_its_own_file(
    tmp_path: Path,
) -> None:
    """`train --federation --missing-cells refuse` was ignored: every party filled its empty
    cells (mean-indicator) while result.json said `refuse`. The policy now travels in the
    set-up (and PSI's fit), and each party refuses its own empty cells, naming its file."""
    from secure_vfl.errors import DataError

    federation, tables = _site(tmp_path)
    config = _laser(tmp_path, missing_cells="refuse")
    side = _label_side(config, federation, tables)
    bodies = setup_bodies(config, side, federation, "none")
    assert bodies["shop"]["missing_cells"] == "refuse"
    shop = tables["shop"]
    holed = shop.frame.copy()
    holed.iloc[bodies["shop"]["fit_rows"][0], 0] = float("nan")
    with_holes = dataclasses.replace(shop, frame=holed)
    setup = _deployment("bank", "shop", "setup", bodies["shop"])
    with pytest.raises(DataError, match="features must not be missing under --missing-cells"):
        build_served_party("shop", setup, with_holes, lambda scheme: None)
    unknown = {**bodies["shop"], "missing_cells": "drop"}
    with pytest.raises(ProtocolError, match="`missing_cells` one of"):
        build_served_party("shop", _deployment("bank", "shop", "setup", unknown), shop, print)


def test_a_setup_with_a_malformed_seed_class_count_or_block_shapes_is_refused_naming_it(
    tmp_path: Path,
) -> None:
    """A set-up whose `block_shapes` lacked the party's (or held a shape that is not a list of
    positive integers), whose seed was outside [0, 2**32) or whose class count was below 2 failed
    with a bare IndexError, TypeError or ValueError ("Overflow when unpacking long long") as the
    refusal the label party read, or was built on; each is refused naming the field."""
    federation, tables = _site(tmp_path)
    config = dataclasses.replace(
        _laser(tmp_path), method_config=MethodConfig(epochs=1, heads="active")
    )
    body = setup_bodies(config, _label_side(config, federation, tables), federation, "none")["shop"]
    shapes = body["block_shapes"]
    wrong: dict[str, dict[str, Any]] = {
        "one block shape per party expected (4); found 1": {"block_shapes": shapes[:1]},
        "`block_shapes` of lists of positive integers expected": {
            "block_shapes": [shapes[0], 7, *shapes[2:]]
        },
        "found ['a']": {"block_shapes": [shapes[0], ["a"], *shapes[2:]]},
        "found [0]": {"block_shapes": [*shapes[:3], [0]]},
        "found [True]": {"block_shapes": [*shapes[:3], [True]]},
        "`seed` must be an integer seed in [0, 2**32). Found 1208925819614629174706176": {
            "seed": 2**80
        },
        "`seed` must be an integer >= 0. Found -1": {"seed": -1},
        "`num_classes` of at least 2 expected, found 1": {"num_classes": 1},
    }
    for expected_error, change in wrong.items():
        setup = _deployment("bank", "shop", "setup", {**body, **change})
        with pytest.raises(ProtocolError, match=re.escape(expected_error)):
            build_served_party("shop", setup, tables["shop"], lambda scheme: None)
    build_served_party(
        "shop", _deployment("bank", "shop", "setup", body), tables["shop"], lambda scheme: None
    )


def test_a_setup_whose_names_are_not_distinct_non_empty_strings_is_refused(
    tmp_path: Path,
) -> None:
    """Only `names[index]` was read, so a set-up whose other names were numbers, empty or the
    party's own name again was built on; `names` must be a list of distinct non-empty
    strings."""
    federation, tables = _site(tmp_path)
    body = setup_bodies(
        _laser(tmp_path), _label_side(_laser(tmp_path), federation, tables), federation, "none"
    )["shop"]
    names = body["names"]
    assert names == list(PARTIES)
    wrong: dict[str, list[Any]] = {
        "found 7": [names[0], names[1], 7, names[3]],
        "found ''": [names[0], names[1], "", names[3]],
        "found None": [None, *names[1:]],
        "found 'shop' twice": [names[0], names[1], "shop", names[3]],
    }
    for expected_error, change in wrong.items():
        setup = _deployment("bank", "shop", "setup", {**body, "names": change})
        with pytest.raises(ProtocolError, match=re.escape(expected_error)) as refused:
            build_served_party("shop", setup, tables["shop"], lambda scheme: None)
        assert "a list of distinct non-empty party names expected" in str(refused.value)


class _AnsweringIds:
    """The label party's endpoint in one process: each data party answers its `ids-request`
    with the ids it is given here (a malicious one's, say)."""

    def __init__(self, ids: dict[str, list[Any]]) -> None:
        self.name = "bank"
        self.ids = ids
        self.answers: list[Any] = []

    def send(self, message: Any) -> None:
        body = {"ids": self.ids[message.receiver], "width": 2}
        self.answers.append(_deployment(message.receiver, self.name, "ids", body))

    def receive(self, *, sender: str, kind: str) -> Any:
        return self.answers.pop(0)


def test_a_data_party_sending_repeated_ids_is_refused_by_its_name(tmp_path: Path) -> None:
    """Repeated ids from a data party in the plain join were refused as "party 1 ids must be
    unique" (its place in the join, which the user never sees), after every party had answered,
    and a prediction took them silently (the later row of an id won); the `ids` message is
    refused naming the party, as the user names it."""
    from secure_vfl.deployment import collect_ids

    federation, tables = _site(tmp_path)
    ids = {name: tables[name].ids.tolist() for name in PARTIES[1:]}
    assert collect_ids(_AnsweringIds(ids), federation)[0][0].tolist() == ids["shop"]
    for wrong, expected_error in [
        ([*ids["insurer"], ids["insurer"][3]], f"found {ids['insurer'][3]!r} more than once"),
        (["", *ids["insurer"]], "found ''"),
    ]:
        endpoint = _AnsweringIds({**ids, "insurer": wrong})
        with pytest.raises(ProtocolError, match=re.escape(expected_error)) as refused:
            collect_ids(endpoint, federation)
        assert str(refused.value).startswith("ids from insurer: distinct non-empty text ids")
