"""`secure-vfl impute --client-file`: what the reader of the user's client files refuses in one
line before any work, and what it keeps out of the imputation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from secure_vfl.cli import main


def write_clients(tmp_path: Path, *, label: str = "label") -> list[Path]:
    """Two client files with ids, three numeric features (empty cells in each) and a label."""
    rng = np.random.default_rng(0)
    paths = []
    for k in range(2):
        frame = pd.DataFrame(rng.normal(size=(30, 3)), columns=["a", "b", "c"])
        frame[rng.random(frame.shape) < 0.1] = np.nan
        frame.insert(0, "id", [f"s{k}-{i:03d}" for i in range(30)])
        frame[label] = rng.integers(0, 2, size=30)
        paths.append(tmp_path / f"site{k}.csv")
        frame.to_csv(paths[-1], index=False)
    return paths


def impute_argv(paths: list[Path], out: Path) -> list[str]:
    argv = ["impute", "--method", "mean", "--out", str(out), "--quiet", "--save-imputed"]
    for path in paths:
        argv += ["--client-file", str(path)]
    return argv


COLUMNS = "['id', 'a', 'b', 'c', 'label']"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--id-column", "foo"],
            f"{{root}}/site0.csv must have an id column `foo` (--id-column). Found columns: "
            f"{COLUMNS}.",
        ),
        (
            ["--label-column", "foo"],
            "a label column `foo` (--label-column) must be in at least one client file. Found "
            f"columns: {{root}}/site0.csv {COLUMNS}; {{root}}/site1.csv {COLUMNS}.",
        ),
    ],
)
def test_a_given_id_or_label_column_the_files_lack_is_refused_naming_their_columns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    paths = write_clients(tmp_path)
    assert main([*impute_argv(paths, tmp_path / "run"), *extra]) == 2
    err = capsys.readouterr().err
    assert message.format(root=tmp_path) in err and len(err.strip().splitlines()) == 1
    assert sorted(tmp_path.iterdir()) == sorted(paths)


def test_a_blank_line_of_a_one_column_file_is_refused_and_a_quoted_empty_cell_read(
    tmp_path: Path,
) -> None:
    """In a file of one column a blank line may be an empty cell (a spreadsheet writes one so):
    it was skipped, its row dropped in silence ("rows 1, filled 0" for a file of two rows).
    An empty cell written as pandas writes it, "", is one."""
    from secure_vfl.data.imputation import read_client_files
    from secure_vfl.errors import DataError

    other = tmp_path / "client-1.csv"
    other.write_text("Ozone,Solar.R\n41,190\n36,118\n")
    path = tmp_path / "client-0.csv"
    for text in ("Solar.R\n190\n\n", 'Solar.R\n""\n\n7\n'):
        path.write_text(text)
        with pytest.raises(DataError, match=r"client-0\.csv: line 3 is blank; in a file of one"):
            read_client_files([path, other])
    path.write_text('Solar.R\n190\n""\n7\n')
    features, (client, _) = read_client_files([path, other])
    column = features.index("Solar.R")
    np.testing.assert_array_equal(client.values[:, column], [190.0, np.nan, 7.0])
    # An id file (`secure-vfl psi`) is one column too, but a blank line there is no id:
    # skipped, as in a file of several columns (the review found it refused).
    from secure_vfl.data.party_files import read_id_file

    ids = tmp_path / "ids.csv"
    for text in ("id\na\nb\n\n", "id\r\na\r\n\r\nb\r\n\r\n"):
        ids.write_text(text)
        assert read_id_file(ids).tolist() == ["a", "b"]


def test_a_client_file_naming_a_column_twice_is_refused_not_renamed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = write_clients(tmp_path)
    text = paths[0].read_text().splitlines()
    assert text[0] == "id,a,b,c,label"
    paths[0].write_text("\n".join(["id,a,a,c,label", *text[1:]]) + "\n")
    assert main(impute_argv(paths, tmp_path / "run")) == 2
    err = capsys.readouterr().err
    assert "site0.csv: column names must be distinct. Found ['a'] repeated." in err
    assert sorted(tmp_path.iterdir()) == sorted(paths)


def test_a_given_label_column_is_written_back_unchanged_and_not_imputed(tmp_path: Path) -> None:
    paths = write_clients(tmp_path, label="outcome")
    out = tmp_path / "run"
    assert main([*impute_argv(paths, out), "--label-column", "outcome"]) == 0
    for path in paths:
        given = pd.read_csv(path, dtype={"id": str})
        imputed = pd.read_csv(out / "imputed" / path.name, dtype={"id": str})
        assert imputed.columns.tolist() == ["id", "a", "b", "c", "outcome"]
        pd.testing.assert_series_equal(imputed["outcome"], given["outcome"])
        pd.testing.assert_series_equal(imputed["id"], given["id"])
        assert not imputed[["a", "b", "c"]].isna().any().any()


class _ServingClients:
    """The coordinator's endpoint in one process: each `columns-request` it sends is answered
    by that client's own handler (`served_columns`) over its own file, as its process would."""

    def __init__(self, members: dict[str, Any]) -> None:
        self.name = "bank"
        self.members = members
        self.answers: list[Any] = []

    def send(self, message: Any) -> None:
        from secure_vfl.deployed_imputation import served_columns
        from secure_vfl.deployment import _deployment

        member = self.members[message.receiver]
        body = served_columns(member, message)
        self.answers.append(_deployment(member.name, self.name, "columns", body))

    def receive(self, *, sender: str, kind: str) -> Any:
        return self.answers.pop(0)


def test_a_deployed_coordinator_refuses_a_label_column_no_client_has(tmp_path: Path) -> None:
    """As in one process: each client says whether its file has the label column asked about,
    and the coordinator refuses a name given that none has, before any statistics."""
    from secure_vfl.deployed_imputation import _columns
    from secure_vfl.errors import ConfigError
    from secure_vfl.experiment import ImputeRunConfig
    from secure_vfl.federation.federation_file import Member

    paths = write_clients(tmp_path, label="outcome")
    members = {
        f"site{k}": Member(f"site{k}", "127.0.0.1:1", tmp_path, tmp_path, data=path)
        for k, path in enumerate(paths)
    }
    endpoint = _ServingClients(members)

    def config(label: str) -> ImputeRunConfig:
        return ImputeRunConfig(
            method="fedhf", client_files=tuple(paths), clients=2, label_column=label
        )

    with pytest.raises(ConfigError, match=r"a label column `result` .* in none of site0, site1"):
        _columns(endpoint, list(members.values()), config("result"))
    schemas = _columns(endpoint, list(members.values()), config("outcome"))
    assert schemas == {"site0": (["a", "b", "c"], 30), "site1": (["a", "b", "c"], 30)}


def _impute_setup(**changes: Any) -> dict[str, Any]:
    """An `impute-setup` body for the client of `write_clients`, with ``changes``."""
    return {
        "method": "fedhf",
        "config": {"rounds": 1},
        "seed": 0,
        "index": 0,
        "features": ["a", "b", "c"],
        "test_fraction": 0.2,
        "secure_agg": "none",
        "id_column": "id",
        "label_column": "label",
        "privacy": None,
        **changes,
    }


def test_a_deployed_client_refuses_a_setup_naming_a_feature_twice(tmp_path: Path) -> None:
    """An `impute-setup` whose `features` named a column twice failed in the client with numpy's
    "IndexError: index 3 is out of bounds for axis 1 with size 3", the text the coordinator read
    as its refusal; it is refused naming the column, before the client reads its file."""
    from secure_vfl.deployed_imputation import build_served_client
    from secure_vfl.deployment import _deployment
    from secure_vfl.errors import ProtocolError
    from secure_vfl.federation.federation_file import Member

    [path, _] = write_clients(tmp_path)
    member = Member("site0", "127.0.0.1:1", tmp_path, tmp_path, data=path)
    body = _impute_setup()

    def build(features: list[str]) -> Any:
        setup = _deployment("bank", "site0", "impute-setup", {**body, "features": features})
        return build_served_client(member, setup, lambda _: None, clients=2)

    with pytest.raises(ProtocolError, match=r"`features` must name distinct columns.*\['a'\]"):
        build(["a", "b", "a", "c"])
    assert build(["a", "b", "c"]).features == ("a", "b", "c")


def test_client_files_read_as_party_files_do(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """A label `NA` was blanked in the imputed table; True/False with an empty cell and Parquet
    decimals were 'non-numeric'; a text cell was refused without naming it; client files in the
    imputed folder were replaced by their imputed tables under --overwrite --save-imputed."""
    import decimal

    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = write_clients(tmp_path)
    frame = pd.read_csv(paths[0], dtype={"id": str})
    frame["label"] = ["NA" if i % 2 else "EU" for i in range(len(frame))]
    frame["flag"] = [["True", "False", ""][i % 3] for i in range(len(frame))]
    frame.to_csv(paths[0], index=False)
    money = pa.array([decimal.Decimal(f"{i}.25") for i in range(30)], pa.decimal128(9, 2))
    table = pa.Table.from_pandas(pd.read_csv(paths[1], dtype={"id": str})).append_column(
        "money", money
    )
    parquet = tmp_path / "site1.parquet"
    pq.write_table(table, parquet)
    paths[1].unlink()
    out = tmp_path / "run"
    assert main(impute_argv([paths[0], parquet], out)) == 0, capsys.readouterr().err
    imputed = pd.read_csv(out / "imputed" / "site0.csv", keep_default_na=False)
    assert imputed["label"].tolist() == frame["label"].tolist()
    # read as numbers, the empty ones filled, and written back as True/False
    flags = imputed["flag"].astype(str)
    assert set(flags) == {"True", "False"}
    given = frame["flag"] != ""
    assert flags[given].tolist() == frame["flag"][given].tolist()
    frame["a"] = frame["a"].astype(object)
    frame.loc[3, "a"] = "?"
    frame.to_csv(paths[0], index=False)
    assert main(impute_argv([paths[0], parquet], tmp_path / "bad")) == 2
    assert "('a' holds '?' at data row 4)" in capsys.readouterr().err
    # A client file inside the folder --save-imputed replaces: refused, the file kept.
    inside = out / "imputed" / "site0.csv"
    argv = [*impute_argv([inside, parquet], out), "--overwrite"]
    assert main(argv) == 2
    assert "lies in" in capsys.readouterr().err and inside.is_file()


def test_features_named_alike_and_id_like_columns_are_warned_of(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `Chol` and `chol ` became two features, each unavailable at the other client, and a
    # `PatientID` column was imputed as a feature: both silently.
    (tmp_path / "h0.csv").write_text(
        "PatientID,Chol,age\n" + "".join(f"{i},{150 + i},{40 + i % 7}\n" for i in range(20))
    )
    (tmp_path / "h1.csv").write_text(
        "chol ,age,bp\n" + "".join(f"{160 + i},{45 + i % 5},{120 + i % 9}\n" for i in range(20))
    )
    out = tmp_path / "run"
    argv = impute_argv([tmp_path / "h0.csv", tmp_path / "h1.csv"], out)
    assert main(argv) == 0
    err = capsys.readouterr().err
    alike = "differ only in case or surrounding spaces are different features"
    assert (
        f"{alike}, each unavailable where it is named otherwise: 'Chol' (h0), 'chol ' (h1)" in err
    )
    assert "h0.csv: 'PatientID' looks like an id column but is imputed as a feature" in err
    assert "give --id-column PatientID" in err
    warned = json.loads((out / "result.json").read_text())["warnings"]
    assert len(warned) == 2 and alike in " ".join(warned)
    # Named alike, and with the id column given: no warning.
    (tmp_path / "h1.csv").write_text(
        "PatientID,Chol,age\n" + "".join(f"{i},{160 + i},{45 + i % 5}\n" for i in range(20))
    )
    assert main([*argv, "--overwrite", "--id-column", "PatientID"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_a_deployed_client_refuses_the_id_column_as_the_label_column(tmp_path: Path) -> None:
    """A `columns-request` (or `impute-setup`) naming one column as both the id and the label
    was answered (the id column then read as a feature, or the label as an unknown one); as in
    one process, the two must differ: refused naming the column, before the file is read."""
    from secure_vfl.deployed_imputation import build_served_client, served_columns
    from secure_vfl.deployment import _deployment
    from secure_vfl.errors import ProtocolError
    from secure_vfl.federation.federation_file import Member

    [path, _] = write_clients(tmp_path)
    member = Member("site0", "127.0.0.1:1", tmp_path, tmp_path, data=path)
    expected = "distinct id and label columns expected; found 'id' as both"
    for column in ("id", "label"):
        request = _deployment(
            "bank", "site0", "columns-request", {"id_column": column, "label_column": column}
        )
        with pytest.raises(ProtocolError, match=expected.replace("'id'", repr(column))):
            served_columns(member, request)
    body = _impute_setup(label_column="id")
    setup = _deployment("bank", "site0", "impute-setup", body)
    with pytest.raises(ProtocolError, match=expected):
        build_served_client(member, setup, lambda _: None, clients=2)
    request = _deployment(
        "bank", "site0", "columns-request", {"id_column": "id", "label_column": "label"}
    )
    assert served_columns(member, request) == {
        "columns": ["a", "b", "c"],
        "rows": 30,
        "label": True,
    }
