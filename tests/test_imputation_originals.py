"""Loaders of FedHF-Impute's original datasets, on tiny files written in the published formats."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from secure_vfl.data.imputation_originals import (
    SECOM_FEATURES,
    UCI_AIRQUALITY_COLUMNS,
    load_physionet_set_a,
    load_secom,
    load_uci_airquality,
)
from secure_vfl.errors import DataError

AIRQUALITY_HEADER = "Date;Time;" + ";".join(UCI_AIRQUALITY_COLUMNS) + ";;"
AIRQUALITY_ROWS = (
    "10/03/2004;18.00.00;2,6;1360;150;11,9;1046;166;1056;113;1692;1268;13,6;48,9;0,7578;;",
    "10/03/2004;19.00.00;-200;1292;112;9,4;955;103;1174;92;1559;972;13,3;47,7;0,7255;;",
    "10/03/2004;20.00.00;2,2;1402;88;9,0;939;131;1140;114;1555;1074;11,9;54,0;0,7502;;",
)


def write_airquality(folder: Path, rows: tuple[str, ...] = AIRQUALITY_ROWS) -> Path:
    path = folder / "AirQualityUCI.csv"
    blank = ";" * 16
    path.write_text("\n".join([AIRQUALITY_HEADER, *rows, blank, blank]) + "\n")
    return path


def test_uci_airquality_reads_decimal_comma_and_minus_200_as_missing(tmp_path):
    path = write_airquality(tmp_path)
    frame = load_uci_airquality(path)
    assert frame.shape == (3, 13) and tuple(frame.columns) == UCI_AIRQUALITY_COLUMNS
    assert (frame.dtypes == np.float64).all()
    assert frame["CO(GT)"].tolist()[0] == 2.6 and np.isnan(frame["CO(GT)"].iloc[1])
    assert frame["AH"].tolist() == [0.7578, 0.7255, 0.7502]
    assert int(frame.isna().sum().sum()) == 1  # the trailing empty rows and columns are gone
    assert load_uci_airquality(tmp_path).equals(frame)  # the directory works as well


def test_uci_airquality_refuses_malformed_files(tmp_path):
    with pytest.raises(DataError, match=r"expected AirQualityUCI.csv at .*Found no such file"):
        load_uci_airquality(tmp_path)
    path = tmp_path / "AirQualityUCI.csv"
    path.write_text("Date,Time,CO(GT)\n10/03/2004,18.00.00,2.6\n")
    with pytest.raises(DataError, match=r"must have the columns .*missing \['Date', 'Time'"):
        load_uci_airquality(path)
    write_airquality(tmp_path, (AIRQUALITY_ROWS[0].replace("1360", "n/a"),))
    with pytest.raises(DataError, match=r"'PT08.S1\(CO\)' must hold numbers .* Found 'n/a' on"):
        load_uci_airquality(path)
    write_airquality(tmp_path, ())
    with pytest.raises(DataError, match=r"at least one data row\. Found none"):
        load_uci_airquality(path)


def secom_line(values: list[str]) -> str:
    return " ".join(values)


def test_secom_reads_590_columns_with_nan(tmp_path):
    first = [str(i) for i in range(SECOM_FEATURES)]
    second = ["NaN" if i % 100 == 0 else f"{i}.5" for i in range(SECOM_FEATURES)]
    (tmp_path / "secom.data").write_text(secom_line(first) + "\n" + secom_line(second) + "\n")
    frame = load_secom(tmp_path)
    assert frame.shape == (2, 590) and frame.columns[0] == "f0" and frame.columns[-1] == "f589"
    assert frame.iloc[0, 589] == 589.0 and frame.iloc[1, 1] == 1.5
    assert int(frame.isna().sum().sum()) == 6


def test_secom_refuses_malformed_files(tmp_path):
    with pytest.raises(DataError, match=r"expected secom.data at .*Found no such file"):
        load_secom(tmp_path)
    path = tmp_path / "secom.data"
    row = ["1"] * SECOM_FEATURES
    path.write_text(secom_line(row) + "\n" + secom_line(row[:-1]) + "\n")
    with pytest.raises(
        DataError, match=r"590 space-separated values per line\. Found 589 on non-e"
    ):
        load_secom(tmp_path)
    path.write_text(secom_line([*row[:3], "abc", *row[4:]]) + "\n")
    with pytest.raises(
        DataError, match=r"numbers or NaN\. Found 'abc' on non-empty line 1, column 3"
    ):
        load_secom(tmp_path)
    path.write_text("\n")
    with pytest.raises(DataError, match=r"at least one line of 590 values\. Found none"):
        load_secom(tmp_path)


PATIENT_A = """Time,Parameter,Value
00:00,RecordID,132539
00:00,Age,54
00:00,Gender,0
00:00,Height,-1
00:00,ICUType,4
00:00,Weight,-1
00:07,GCS,15
00:37,HR,72
01:37,HR,80
47:50,HR,70
36:00,BaseExcess,-1
"""
PATIENT_B = """Time,Parameter,Value
00:00,RecordID,132540
00:00,Age,76
00:00,Gender,1
00:00,Height,175.3
00:00,ICUType,2
00:00,Weight,76
05:00,Weight,80
02:10,Temp,37.2
"""


def write_set_a(root: Path) -> Path:
    folder = root / "set-a"
    folder.mkdir()
    (folder / "132539.txt").write_text(PATIENT_A)
    (folder / "132540.txt").write_text(PATIENT_B)
    return folder


def test_physionet_rows_are_per_patient_means_with_static_descriptors(tmp_path):
    folder = write_set_a(tmp_path)
    frame = load_physionet_set_a(tmp_path)
    assert list(frame.index) == ["132539", "132540"] and frame.index.name == "RecordID"
    columns = ["Age", "BaseExcess", "GCS", "Gender", "HR", "Height", "Temp", "Weight"]
    assert list(frame.columns) == columns  # sorted; RecordID and ICUType dropped
    a, b = frame.loc["132539"], frame.loc["132540"]
    assert a["HR"] == pytest.approx(74.0) and a["Age"] == 54 and a["Gender"] == 0
    assert np.isnan(a["Height"]) and np.isnan(a["Weight"])  # -1 in a descriptor is missing
    assert a["BaseExcess"] == -1.0  # a real measurement, not a missing marker
    assert np.isnan(a["Temp"]) and b["Weight"] == pytest.approx(78.0)
    assert b["Height"] == pytest.approx(175.3)
    assert load_physionet_set_a(folder).equals(frame)  # set-a itself works as well


def test_physionet_refuses_malformed_files(tmp_path):
    with pytest.raises(DataError, match=r"expected the directory set-a/ at .*Found none"):
        load_physionet_set_a(tmp_path)
    folder = tmp_path / "set-a"
    folder.mkdir()
    with pytest.raises(DataError, match=r"expected RECORDID.txt files in .*Found none"):
        load_physionet_set_a(tmp_path)
    record = folder / "1.txt"
    record.write_text("Parameter,Value\nHR,70\n")
    with pytest.raises(DataError, match=r"1.txt must start with the header 'Time,Parameter,Value'"):
        load_physionet_set_a(tmp_path)
    record.write_text("Time,Parameter,Value\n0:37:00,HR,70\n")
    with pytest.raises(DataError, match=r"1.txt line 2: time must be HH:MM. Found '0:37:00'"):
        load_physionet_set_a(tmp_path)
    record.write_text("Time,Parameter,Value\n00:37,HR,high\n")
    with pytest.raises(DataError, match=r"value of 'HR' must be a number. Found 'high'"):
        load_physionet_set_a(tmp_path)
    record.write_text("Time,Parameter,Value\n00:37,HR\n")
    with pytest.raises(DataError, match=r"1.txt line 2 must be `Time,Parameter,Value`"):
        load_physionet_set_a(tmp_path)
