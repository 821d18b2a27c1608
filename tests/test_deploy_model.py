"""Saved models under ``--federation``: every party its own process on loopback (gRPC with
mutual TLS, no mock); at the end of the run each live data party writes its own part into its
own model directory and answers with its files' SHA-256, the label party writes its part and
the manifest. Copied into one place, the parts predict exactly as the in-process run's saved
model; a tampered part is refused naming its party. Every process started here is stopped by
its pid when the test ends, passed or failed. The message checks of both sides and the
manifest's new fields are unit-tested without processes."""

from __future__ import annotations

import json
import re
import shutil
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import pandas as pd
import pytest
import torch
from sklearn.datasets import load_breast_cancer
from test_deploy import (
    PARTIES,
    PROCESS_SECONDS,
    Processes,
    flags_for,
    in_process,
    write_federation,
    write_party_files,
)
from test_deploy_resume import LoopbackEndpoint

from protocols import tls
from secure_vfl.cli import main
from secure_vfl.data.party_files import read_party_file
from secure_vfl.deployment import (
    SAVED_THEN_STOPPED,
    ServedModel,
    _deployment,
    _saved_run,
    _Server,
    fitted_widths,
    model_directory,
    save_deployed,
)
from secure_vfl.errors import ConfigError, DataError, IntegrityError, ProtocolError, TransportError
from secure_vfl.experiment import TrainConfig, build_method, prepare_data
from secure_vfl.federation.channel import Channel, read_capture
from secure_vfl.federation.federation_file import read_federation
from secure_vfl.federation.messages import DeploymentMessage
from secure_vfl.federation.network import free_loopback_ports
from secure_vfl.federation.parties import DataParty
from secure_vfl.federation.parts import (
    PART_INDEX,
    TRAINING_SAMPLES_FILE,
    TrainingSamples,
    sha256,
)
from secure_vfl.methods import MethodConfig
from secure_vfl.methods.base import in_process_parties
from secure_vfl.saved_model import (
    KEPT_BY_PARTY,
    LOST,
    MANIFEST_FILE,
    Manifest,
    SavedModel,
    read_manifest,
)

pytestmark = pytest.mark.processes  # party processes, loopback endpoints, deadlines

NEW_ROWS = range(240, 300)  # breast-cancer rows the federation never saw


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("deploy-model")
    write_party_files(directory)
    write_new_rows(directory / "new")
    tls.make_federation(directory / "certs", [*PARTIES, "aggregator"])
    return directory


def write_new_rows(directory: Path) -> None:
    """Each party's file of new rows (its own columns of the training files), a few ids
    missing at every party but the first, in its own row order."""
    directory.mkdir()
    features = load_breast_cancer(as_frame=True).data
    rng = np.random.default_rng(1)
    for k, (name, columns) in enumerate(
        zip(PARTIES, np.array_split(np.array(features.columns), 4), strict=True)
    ):
        frame = features[list(columns)].iloc[list(NEW_ROWS)].copy()
        frame.insert(0, "id", [f"new{i:04d}" for i in NEW_ROWS])
        kept = np.sort(rng.choice(len(frame), size=len(frame) - 3 * k, replace=False))
        frame.iloc[rng.permutation(kept)].to_csv(directory / f"{name}.csv", index=False)


def new_tables(site: Path, absent: str | None = None) -> dict[str, Any]:
    paths = {name: site / "new" / f"{name}.csv" for name in PARTIES if name != absent}
    return {name: (read_party_file(path), str(path)) for name, path in paths.items()}


def part_directories(root: Path) -> set[Path]:
    """Every directory under ``root`` that holds a saved part."""
    return {index.parent for index in root.rglob(PART_INDEX)}


def train_keeping_parts(
    site: Path, processes: Processes, tmp_path: Path, *flags: str
) -> tuple[Path, dict[str, Path]]:
    """A deployed run that saves its model, each data party keeping its part in its own
    ``--model-dir``: the run directory and those directories, by party."""
    federation = write_federation(site, site / "certs", free_loopback_ports(5))
    models = {name: tmp_path / f"{name}-models" for name in PARTIES[1:]}
    servers = [processes.serve(federation, n, "--model-dir", str(models[n])) for n in PARTIES[1:]]
    servers.append(processes.serve(federation, "aggregator"))
    out = tmp_path / "deployed"
    label = processes.start(
        "train", "--federation", str(federation), "--name", "bank", *flags_for(flags),
        "--out", str(out), log="bank",
    )  # fmt: skip
    assert label.wait(timeout=PROCESS_SECONDS) == 0, processes.log("bank")
    codes = [server.wait(timeout=PROCESS_SECONDS) for server in servers]
    assert codes == [0, 0, 0, 0], [processes.log(n) for n in (*PARTIES[1:], "aggregator")]
    return out, models


def copy_parts(
    out: Path, models: dict[str, Path], copy: Path, names: Sequence[str] = PARTIES[1:]
) -> Path:
    """The deployed model at ``out`` with the parts of the data parties ``names`` (default:
    every one) copied beside the manifest."""
    run = read_manifest(out)[0].run_id
    shutil.copytree(out / "model", copy)
    for name in names:
        shutil.copytree(models[name] / name / run, copy / name)
    return copy


def predict_where_parts_live(
    site: Path,
    processes: Processes,
    out: Path,
    models: dict[str, Path],
    written: Path,
    *flags: str,
    absent: str | None = None,
    serve: Sequence[str] = (),
    aggregator: Sequence[str] = (),
    files: str = "new",
) -> int:
    """`predict --federation` of the model at ``out`` into ``written``, every data party but
    ``absent`` serving its new rows (``files``: the folder of the site they are in; "" for the
    training files) with its part (``serve``: its further flags); the label party's exit code
    (every serving process exits 0 when it does)."""
    federation = write_federation(site, site / "certs", free_loopback_ports(5))
    served = []
    for n in PARTIES[1:]:
        if n != absent:
            rows = ["--data", str(site / files / f"{n}.csv"), "--model-dir", str(models[n])]
            served.append(processes.serve(federation, n, *rows, *serve))
    served.append(processes.serve(federation, "aggregator", *aggregator))
    label = processes.start(
        "predict", "--federation", str(federation), "--name", "bank", "--model", str(out),
        "--party-file", str(site / files / "bank.csv"), "--out", str(written), *flags,
        log="bank",
    )  # fmt: skip
    code = label.wait(timeout=PROCESS_SECONDS)
    codes = [server.wait(timeout=PROCESS_SECONDS) for server in served]
    assert codes == [0] * len(served) or code != 0, [processes.log(n) for n in PARTIES[1:]]
    return code


def test_a_deployed_run_saves_each_part_at_its_party_and_predicts_as_the_in_process_model(
    site: Path, processes: Processes, tmp_path: Path
) -> None:
    flags = ("--method", "laser", "--heads", "all")
    alone = in_process(site, tmp_path / "alone", *flags)
    out, models = train_keeping_parts(site, processes, tmp_path, *flags)
    result = json.loads((out / "result.json").read_text())
    assert result["metrics"] == alone["metrics"]  # the same model as in one process

    # The label party holds the manifest and its own part; each data party its own, nowhere else.
    manifest, _ = read_manifest(out)
    run = manifest.run_id
    assert result["model"]["run_id"] == run
    assert json.loads((out / "model" / MANIFEST_FILE).read_text())["version"] == 2
    assert [(e.name, e.location) for e in manifest.parties] == [
        ("bank", "here"),
        *[(name, KEPT_BY_PARTY) for name in PARTIES[1:]],
    ]
    assert sorted(p.name for p in (out / "model").iterdir()) == ["bank", MANIFEST_FILE]
    for entry in manifest.parties[1:]:
        part = models[entry.name] / entry.name / run
        held = sorted(p.relative_to(models[entry.name]) for p in models[entry.name].rglob("*"))
        assert held == sorted(
            [
                Path(entry.name),
                Path(entry.name, run),
                *(Path(entry.name, run, f) for f in entry.files),
            ]
        )
        assert {f: sha256((part / f).read_bytes()) for f in entry.files} == entry.files
        assert f"{entry.name}: saved its part of model {run}" in processes.log(entry.name)
    saved = part_directories(tmp_path) - part_directories(tmp_path / "alone")
    assert saved == {out / "model" / "bank", *[models[n] / n / run for n in PARTIES[1:]]}
    assert part_directories(site) == set()  # the default directory beside the data: unused
    assert f"kept by shop, insurer, telco (each in its --model-dir, NAME/{run}/)" in (
        processes.log("bank")
    )

    copy = copy_parts(out, models, tmp_path / "copied")
    deployed, in_memory = SavedModel.load(copy), SavedModel.load(tmp_path / "alone")
    # Loaded with the parts copied beside the manifest: a party whose part is not is absent
    # from every row, as if its file were left out, and its file is refused naming where the
    # part lies; with none copied the label party predicts from its own block alone.
    partly = SavedModel.load(copy_parts(out, models, tmp_path / "partly", ["shop", "telco"]))
    uncopied = "its part is kept by that party and was not copied here"
    assert partly.absent == {"insurer": uncopied} and deployed.absent == {}
    np.testing.assert_allclose(
        partly.predict(new_tables(site, "insurer")).probabilities,
        deployed.predict(new_tables(site, "insurer")).probabilities,
        rtol=0,
        atol=1e-6,
    )
    with pytest.raises(DataError, match=r"the part of insurer is kept by that party .* not copied"):
        partly.predict(new_tables(site))
    bare = SavedModel.load(out)
    assert bare.absent == {name: uncopied for name in PARTIES[1:]}
    own = {"bank": new_tables(site)["bank"]}
    np.testing.assert_allclose(
        bare.predict(own).probabilities, in_memory.predict(own).probabilities, atol=1e-6
    )
    for absent in (None, "insurer"):
        ours, theirs = (
            deployed.predict(new_tables(site, absent)),
            in_memory.predict(new_tables(site, absent)),
        )
        assert ours.ids.tolist() == theirs.ids.tolist() and len(ours.ids) == len(NEW_ROWS)
        assert np.isfinite(ours.probabilities).all()
        np.testing.assert_allclose(ours.probabilities, theirs.probabilities, rtol=0, atol=1e-6)
        assert ours.labels() == theirs.labels()
    # The command line predicts from the copy as from any saved model.
    predictions = tmp_path / "p.csv"
    files = [a for n in PARTIES for a in ("--party-file", str(site / "new" / f"{n}.csv"))]
    assert main(["predict", "--model", str(copy), *files, "--out", str(predictions)]) == 0
    written = pd.read_csv(predictions, dtype={"id": str})
    probabilities = deployed.predict(new_tables(site)).probabilities
    np.testing.assert_allclose(written[["p_0", "p_1"]].to_numpy(), probabilities, atol=1e-6)

    # A part altered after the party reported its hashes is refused, naming the party.
    [weights, *_] = sorted((copy / "insurer").glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"^insurer: .* does not match the SHA-256"):
        SavedModel.load(copy)

    # Where the parts live: each data party loads its own part in its own process and serves
    # its own new rows; the same predictions as the in-process model, with every party, with
    # one that is not running (absent for every row), and aligned by PSI (no id crosses in the
    # clear; the label party's own rows are predicted: here it holds every new id).
    for absent, align in ((None, "join"), ("insurer", "join"), (None, "psi")):
        written = tmp_path / f"live-{absent}-{align}.csv"
        psi_only = ["--align", "psi"] if align == "psi" else []  # refuses the join
        code = predict_where_parts_live(
            site, processes, out, models, written, "--wait", "3", "--align", align,
            absent=absent, serve=psi_only,
        )  # fmt: skip
        assert code == 0, processes.log("bank")
        frame = pd.read_csv(written, dtype={"id": str})
        theirs = in_memory.predict(new_tables(site, absent))
        assert frame["id"].tolist() == theirs.ids.tolist()
        np.testing.assert_allclose(
            frame[["p_0", "p_1"]].to_numpy(), theirs.probabilities, rtol=0, atol=1e-6
        )
        assert frame["predicted"].tolist() == theirs.labels()
        if absent is not None:
            assert f"absent: {absent} (not reachable within 3 s)" in processes.log("bank")
        else:
            assert "predicting with its own part of the model" in processes.log("shop")
        if align == "psi":
            assert "aligning by PSI with bank" in processes.log("shop")
    # Sealed sums need a model whose heads take them (heads active): refused before any set-up.
    written = tmp_path / "heads-all-masks.csv"
    code = predict_where_parts_live(site, processes, out, models, written, "--secure-agg", "masks")
    assert code == 2 and "cannot run under secure aggregation" in processes.log("bank")
    # A part altered at its party after it reported its hashes: that party refuses to load it,
    # and the prediction fails naming it.
    [weights, *_] = sorted((models["telco"] / "telco" / run).glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-1] + bytes([weights.read_bytes()[-1] ^ 1]))
    written = tmp_path / "tampered.csv"
    assert predict_where_parts_live(site, processes, out, models, written) != 0
    assert not written.exists()
    assert re.search(r"telco cannot load its part of model .*SHA-256", processes.log("bank"))
    # telco names its part's file to the label party without its own directories' paths.
    assert "<its model directory>" in processes.log("bank"), processes.log("bank")
    assert str(models["telco"]) not in processes.log("bank")
    assert str(models["telco"]) in processes.log("telco")


def test_a_model_trained_under_masks_predicts_under_masks_where_its_parts_live(
    site: Path, processes: Processes, tmp_path: Path
) -> None:
    """LASER (heads active) trained under masks predicts with every part where it lives and the
    representations sealed: the aggregation server takes only sealed shares, and the
    predictions are those of its parts copied into one place (which plan the same sums). With
    a party not served it predicts from the others (its key set-up asked the absent party for
    its keys, and the prediction failed naming a chain of refusals)."""
    flags = ("--method", "laser", "--heads", "active", "--secure-agg", "masks")
    out, models = train_keeping_parts(site, processes, tmp_path, *flags)
    expected = SavedModel.load(copy_parts(out, models, tmp_path / "copied"))
    for absent in (None, "insurer"):
        capture, written = tmp_path / f"aggregator-{absent}.capture", tmp_path / f"{absent}.csv"
        code = predict_where_parts_live(
            site, processes, out, models, written, "--secure-agg", "masks", "--wait", "3",
            absent=absent, aggregator=["--capture", str(capture)],
        )  # fmt: skip
        assert code == 0, processes.log("bank")
        assert_predicted(written, expected.predict(new_tables(site, absent)), atol=1e-5)
        messages = list(read_capture(capture))
        kinds = {message.kind for message in messages}
        assert "sealed" in kinds and "representation" not in kinds, kinds
        assert absent not in {message.sender for message in messages}
    # The ids it trained on, predicted again (each party serving its training file): the label
    # party's part keeps its training samples (salted digests, no id in the clear), and both
    # paths sum those ids by their training blocks (F29), so they agree.
    samples = out / "model" / "bank" / TRAINING_SAMPLES_FILE
    assert samples.is_file() and b"p0001" not in samples.read_bytes()
    written = tmp_path / "training-ids.csv"
    code = predict_where_parts_live(
        site, processes, out, models, written, "--secure-agg", "masks", files=""
    )
    assert code == 0, processes.log("bank")
    training = {name: (read_party_file(site / f"{name}.csv"), name) for name in PARTIES}
    assert_predicted(written, expected.predict(training), atol=1e-5)
    trained = TrainingSamples.from_bytes(samples.read_bytes(), str(samples)).digests.shape[0]
    assert cast(Any, expected.method).blocks.matched("predict") == trained > 100


def test_a_false_vfl_model_predicts_where_its_parts_live_as_from_its_copied_parts(
    site: Path, processes: Processes, tmp_path: Path
) -> None:
    """FALSE-VFL-II trained deployed: each data party predicts with its own encoder in its own
    process, as the same parts copied into one place predict."""
    flags = ("--method", "false-vfl-2", "--labeled", "100", "--kappa", "3")
    out, models = train_keeping_parts(site, processes, tmp_path, *flags)
    expected = SavedModel.load(copy_parts(out, models, tmp_path / "copied"))
    written = tmp_path / "p.csv"
    assert predict_where_parts_live(site, processes, out, models, written) == 0
    assert_predicted(written, expected.predict(new_tables(site)), atol=1e-6)


def assert_predicted(written: Path, expected: Any, *, atol: float) -> None:
    """The predictions file ``written`` holds ``expected``'s ids and probabilities."""
    frame = pd.read_csv(written, dtype={"id": str})
    assert frame["id"].tolist() == expected.ids.tolist()
    np.testing.assert_allclose(
        frame[["p_0", "p_1"]].to_numpy(), expected.probabilities, rtol=0, atol=atol
    )


# Loaded by the interpreter of one party process only (its PYTHONPATH): the process kills
# itself with SIGKILL at the rename that would publish a directory written atomically (its
# saved part, written and fsynced under a hidden temporary name), as a crash would.
DIE_AT_PUBLISH = """
import os
import signal

_rename = os.rename


def _rename_or_die(source, target, *args, **kwargs):
    if str(source).endswith(".tmp"):
        os.kill(os.getpid(), signal.SIGKILL)
    return _rename(source, target, *args, **kwargs)


os.rename = _rename_or_die
"""


def test_a_party_killed_while_it_saves_its_part_is_lost_there_and_the_run_ends(
    site: Path, processes: Processes, tmp_path: Path
) -> None:
    """telco's process dies (SIGKILL) in the middle of writing its part, once its files are
    written and before they are published under the model's run id: the label party finds it
    gone, lists its part as lost with a ``saving`` fault, saves the others and ends 0; telco
    leaves no part under the run id (its temporary directory only)."""
    flags = ("--method", "laser", "--heads", "all")
    federation = write_federation(site, site / "certs", free_loopback_ports(5))
    models = {name: tmp_path / f"{name}-models" for name in PARTIES[1:]}
    servers = [processes.serve(federation, n, "--model-dir", str(models[n])) for n in PARTIES[1:3]]
    servers.append(processes.serve(federation, "aggregator"))
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(DIE_AT_PUBLISH)
    telco = processes.start(
        "party", "serve", "--federation", str(federation), "--name", "telco", "--model-dir",
        str(models["telco"]), log="telco", before=[hooks],
    )  # fmt: skip
    out = tmp_path / "deployed"
    label = processes.start(
        "train", "--federation", str(federation), "--name", "bank", *flags_for(flags),
        "--out", str(out), log="bank",
    )  # fmt: skip
    assert label.wait(timeout=PROCESS_SECONDS) == 0, processes.log("bank")
    assert telco.wait(timeout=PROCESS_SECONDS) == -signal.SIGKILL
    codes = [server.wait(timeout=PROCESS_SECONDS) for server in servers]
    assert codes == [0, 0, 0], [processes.log(n) for n in ("shop", "insurer", "aggregator")]
    result = json.loads((out / "result.json").read_text())
    [fault] = result["faults"]
    assert fault["party"] == "telco" and fault["phase"] == "saving", fault
    assert set(result["metrics"]) == set(result["samples"]) - {"train"}  # evaluated with it
    manifest, _ = read_manifest(out)
    assert [(e.name, e.location) for e in manifest.parties] == [
        ("bank", "here"),
        ("shop", KEPT_BY_PARTY),
        ("insurer", KEPT_BY_PARTY),
        ("telco", LOST),
    ]
    for name in ("shop", "insurer"):
        assert (models[name] / name / manifest.run_id).is_dir()
    [left] = (models["telco"] / "telco").iterdir()  # written, never published
    assert left.name.startswith(f".{manifest.run_id}.") and left.name.endswith(".tmp")
    assert "telco is lost while saving the model" in processes.log("bank")
    # Loaded, the model predicts without telco's block (its part lost, its rows absent).
    copy = tmp_path / "copied"
    shutil.copytree(out / "model", copy)
    for name in ("shop", "insurer"):
        shutil.copytree(models[name] / name / manifest.run_id, copy / name)
    predicted = SavedModel.load(copy).predict(new_tables(site, "telco"))
    assert len(predicted.ids) == len(NEW_ROWS) and np.isfinite(predicted.probabilities).all()


# -- the message checks and the manifest's fields, without processes ----------------------

RUN = "0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def federation_parties(site: Path) -> tuple[TrainConfig, Any, list[DataParty]]:
    """An untrained LASER federation of the site's files, its parties named as in the
    federation file (the label party bank first)."""
    config = TrainConfig(
        method="laser",
        party_files=tuple(site / f"{name}.csv" for name in PARTIES),
        label_file=site / "labels.csv",
        method_config=MethodConfig(epochs=1, batch_size=64, representation_dim=8),
    )
    data = prepare_data(config)
    channel = Channel()
    channel.party_names = list(PARTIES)
    build_method(config, data, channel=channel)
    return config, data, in_process_parties(channel)


def test_a_served_party_saves_its_part_only_on_a_request_that_checks_out(
    tmp_path: Path, federation_parties: tuple[TrainConfig, Any, list[DataParty]]
) -> None:
    shop = federation_parties[2][1]
    served = ServedModel("shop", tmp_path)
    with pytest.raises(ProtocolError, match="a run id of 32 hex digits expected"):
        served.save(shop.save_part, {"run": "../../elsewhere"})
    answer = served.save(shop.save_part, {"run": RUN})
    part = tmp_path / "shop" / RUN
    assert answer["run"] == RUN and answer["files"] == {
        p.name: sha256(p.read_bytes()) for p in part.iterdir()
    }
    assert PART_INDEX in answer["files"] and any(
        f.endswith(".safetensors") for f in answer["files"]
    )
    with pytest.raises(ProtocolError, match="a second save of the run"):
        served.save(shop.save_part, {"run": "f" * 32})  # one save per run, whatever the id
    with pytest.raises(ProtocolError, match="already exists"):
        ServedModel("shop", tmp_path).save(shop.save_part, {"run": RUN})  # a replay in a later run
    with pytest.raises(ProtocolError, match="keeps no model directory"):
        ServedModel("shop", None).save(shop.save_part, {"run": RUN})
    assert [p.relative_to(tmp_path) for p in tmp_path.iterdir()] == [Path("shop")]
    assert [p.name for p in (tmp_path / "shop").iterdir()] == [RUN]  # no temporary left


def test_a_served_party_removes_its_part_of_a_run_that_ended_without_a_model(
    tmp_path: Path, federation_parties: tuple[TrainConfig, Any, list[DataParty]]
) -> None:
    """A run that failed after the parties saved their parts leaves the label party no manifest
    (it removes its run's directory): the parts it told to stay were whole, and orphaned, easy
    to take for a model. Told the run failed (or was interrupted), a party removes its own;
    told it finished, it keeps it."""
    shop = federation_parties[2][1]
    kept, failed = ServedModel("shop", tmp_path / "kept"), ServedModel("shop", tmp_path / "f")
    for served in (kept, failed):
        served.save(shop.save_part, {"run": RUN})
    assert kept.end("finished") is None and (tmp_path / "kept" / "shop" / RUN).is_dir()
    assert failed.end("failed") == tmp_path / "f" / "shop" / RUN
    assert list((tmp_path / "f" / "shop").iterdir()) == []  # nothing left, not even aside
    assert failed.end("interrupted") is None  # nothing saved any more
    assert ServedModel("shop", tmp_path / "none").end("failed") is None
    # Stopped once the label party's manifest was in place (it names every part): kept.
    late = ServedModel("shop", tmp_path / "late")
    late.save(shop.save_part, {"run": RUN})
    assert late.end(SAVED_THEN_STOPPED) is None and late.part_directory(RUN).is_dir()


def test_a_label_party_tells_whether_its_manifest_of_a_run_is_in_place(tmp_path: Path) -> None:
    """What decides, when a deployed run fails after it asked the parties to save, whether
    they keep their parts: its own manifest, naming the run, in place."""
    assert _saved_run(tmp_path) is None  # none written
    (tmp_path / "manifest.json").write_text(json.dumps({"run_id": RUN}))
    assert _saved_run(tmp_path) == RUN
    (tmp_path / "manifest.json").write_text("{not json")
    assert _saved_run(tmp_path) is None


def test_the_label_party_saves_every_live_party_checks_every_answer_and_marks_the_lost(
    site: Path, tmp_path: Path, federation_parties: tuple[TrainConfig, Any, list[DataParty]]
) -> None:
    config, data, parties = federation_parties
    federation = read_federation(write_federation(tmp_path, tmp_path, free_loopback_ports(5)))
    served = {p.name: ServedModel(p.name, tmp_path / "at" / p.name) for p in parties[1:]}
    lie: dict[str, Any] = {}

    def answer(message: DeploymentMessage) -> tuple[str, dict[str, Any]]:
        assert message.topic == "save"
        side = served[message.receiver]
        side.saved = None  # each save below is a new run for the serving side
        party = parties[PARTIES.index(message.receiver)]
        return "saved", {**side.save(party.save_part, json.loads(message.body)), **lie}

    endpoint: Any = LoopbackEndpoint(answer)  # the label party's side
    model = tmp_path / "model"
    manifest, _ = save_deployed(model, endpoint, federation, parties[0], config, data, ["insurer"])
    assert endpoint.handler == "the label party" and endpoint.kept == []  # handed back
    assert [(e.name, e.location) for e in manifest.parties] == [
        ("bank", "here"),
        ("shop", KEPT_BY_PARTY),
        ("insurer", LOST),
        ("telco", KEPT_BY_PARTY),
    ]
    assert not (tmp_path / "at" / "insurer").exists()  # the lost party was asked nothing
    for entry in (manifest.parties[1], manifest.parties[3]):
        part = tmp_path / "at" / entry.name / entry.name / manifest.run_id
        assert entry.files == {p.name: sha256(p.read_bytes()) for p in part.iterdir()}
    assert sorted(p.name for p in model.iterdir()) == ["bank", MANIFEST_FILE]
    # A party that answers for another run, with a bad digest or a path for a name: refused.
    lies: dict[str, dict[str, Any]] = {
        "found run 'ffff": {"run": "f" * 32},
        "SHA-256 (64 hex digits) per plain file name": {"files": {"part.json": "0" * 63}},
        "files ['../../bank/part.json']": {"files": {"../../bank/part.json": "0" * 64}},
    }
    before = (model / MANIFEST_FILE).read_bytes()
    for reason, told in lies.items():
        lie.clear()
        lie.update(told)
        with pytest.raises(ProtocolError, match=re.escape(reason)) as refused:
            save_deployed(model, endpoint, federation, parties[0], config, data, [])
        assert str(refused.value).startswith("saved from shop: ")
        # the model saved before is left whole, and nothing half-saved beside it
        assert (model / MANIFEST_FILE).read_bytes() == before
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".model")) == []
        endpoint.kept.clear()

    # Copied beside the manifest, the parts load; the lost party is absent from every row.
    lie.clear()
    manifest, _ = save_deployed(model, endpoint, federation, parties[0], config, data, ["insurer"])
    for name in ("shop", "telco"):
        shutil.copytree(tmp_path / "at" / name / name / manifest.run_id, model / name)
    loaded = SavedModel.load(model)
    assert loaded.lost == ("insurer",)
    predictions = loaded.predict(new_tables(site, absent="insurer"))
    assert not predictions.mask[:, 2].any() and predictions.mask[:, [0, 1, 3]].any(axis=0).all()
    assert np.isfinite(predictions.probabilities).all()
    with pytest.raises(ConfigError, match="insurer was lost in training and saved no part"):
        loaded.predict(new_tables(site))


def test_a_party_lost_while_the_model_is_saved_is_listed_lost_and_the_others_are_saved(
    tmp_path: Path, federation_parties: tuple[TrainConfig, Any, list[DataParty]]
) -> None:
    config, data, parties = federation_parties
    federation = read_federation(write_federation(tmp_path, tmp_path, free_loopback_ports(5)))
    served = {p.name: ServedModel(p.name, tmp_path / "at" / p.name) for p in parties[1:]}
    gone = "telco 127.0.0.1: could not be reached: its process is gone"

    def answer(message: DeploymentMessage) -> tuple[str, dict[str, Any]]:
        if message.receiver == "telco":  # died after the evaluation, before the save
            raise TransportError(gone)
        party = parties[PARTIES.index(message.receiver)]
        return "saved", served[message.receiver].save(party.save_part, json.loads(message.body))

    endpoint: Any = LoopbackEndpoint(answer)
    model = tmp_path / "model"
    # Only a party that can no longer be reached is lost there: any other failure fails the run.
    with pytest.raises(TransportError, match="its process is gone"):
        save_deployed(model, endpoint, federation, parties[0], config, data, [], lambda _: [])
    assert not (model / MANIFEST_FILE).exists()
    endpoint.handler = "the label party"
    for side in served.values():
        side.saved = None
    manifest, lost = save_deployed(
        model, endpoint, federation, parties[0], config, data, [], lambda names: list(names)
    )
    assert lost == {"telco": gone}
    assert [(e.name, e.location) for e in manifest.parties] == [
        ("bank", "here"),
        ("shop", KEPT_BY_PARTY),
        ("insurer", KEPT_BY_PARTY),
        ("telco", LOST),
    ]
    written = json.loads((model / MANIFEST_FILE).read_text())  # what predict will read
    assert [entry["location"] for entry in written["parties"]] == ["here", "party", "party", "lost"]


def test_the_label_party_takes_each_partys_model_input_shape_and_refuses_a_bad_one(
    tmp_path: Path,
) -> None:
    federation = read_federation(write_federation(tmp_path, tmp_path, free_loopback_ports(5)))
    told: dict[str, list[Any]] = {"shop": [12], "insurer": [7], "telco": [7]}
    asked: list[dict[str, Any]] = []

    def answer(message: DeploymentMessage) -> tuple[str, dict[str, Any]]:
        assert message.topic == "fit"
        asked.append(json.loads(message.body))
        return "fitted", {"shape": told[message.receiver]}

    endpoint: Any = LoopbackEndpoint(answer)
    endpoint.handler = None  # before the set-up no party is attached
    plan: Any = type("Plan", (), {"fit_rows": [np.arange(k, k + 3) for k in range(4)]})
    assert fitted_widths(endpoint, federation, plan, "join") == [12, 7, 7]
    assert asked == [
        {"fit_rows": [k, k + 1, k + 2], "align": "join", "missing_cells": "mean-indicator"}
        for k in (1, 2, 3)
    ]
    for bad in ([0], [3, 4], ["12"], [2**21], []):
        told["telco"] = bad
        endpoint.kept.clear()
        with pytest.raises(ProtocolError, match="the shape of a tabular block"):
            fitted_widths(endpoint, federation, plan, "join")


def test_manifest_locations_are_checked_and_version_1_still_reads(
    tmp_path: Path, federation_parties: tuple[TrainConfig, Any, list[DataParty]]
) -> None:
    config, data, parties = federation_parties
    federation = read_federation(write_federation(tmp_path, tmp_path, free_loopback_ports(5)))
    served = {p.name: ServedModel(p.name, tmp_path / "at") for p in parties[1:]}

    def answer(message: DeploymentMessage) -> tuple[str, dict[str, Any]]:
        party = parties[PARTIES.index(message.receiver)]
        return "saved", served[message.receiver].save(party.save_part, json.loads(message.body))

    endpoint: Any = LoopbackEndpoint(answer)  # the label party's side
    manifest, _ = save_deployed(
        tmp_path / "m", endpoint, federation, parties[0], config, data, ["telco"]
    )
    payload = manifest.to_json()
    assert payload["version"] == 2
    assert Manifest.from_json(json.loads(json.dumps(payload)), "m") == manifest
    # A version-1 manifest (every part beside it; no `location`) reads as before.
    old = {**payload, "version": 1, "parties": [dict(p) for p in payload["parties"][:3]]}
    old["block_shapes"] = payload["block_shapes"][:3]
    for entry in old["parties"]:
        entry.pop("location")
    assert [e.location for e in Manifest.from_json(old, "v1").parties] == ["here"] * 3
    broken = {
        "manifest version 1 or 2 expected": {**payload, "version": 3},
        "a location of here, party, lost expected": _entry_changed(payload, 1, location="there"),
        "with file hashes unless 'lost'; found location 'lost' and 4 files": _entry_changed(
            payload, 1, location=LOST
        ),
        "found location 'party' and 0 files": _entry_changed(payload, 3, location=KEPT_BY_PARTY),
    }
    for reason, document in broken.items():
        with pytest.raises(DataError, match=re.escape(reason)):
            Manifest.from_json(document, "m")


def _entry_changed(payload: dict[str, Any], k: int, **changes: Any) -> dict[str, Any]:
    parties = [dict(p) for p in payload["parties"]]
    parties[k].update(changes)
    return {**payload, "parties": parties}


def test_a_model_directory_defaults_beside_the_data_and_the_aggregator_keeps_none(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_federation(site, site / "certs", free_loopback_ports(5))
    federation = read_federation(path)
    assert model_directory(federation, "shop", None) == site / "models"
    assert model_directory(federation, "shop", tmp_path) == tmp_path
    assert model_directory(federation, "aggregator", None) is None
    with pytest.raises(ConfigError, match="keeps no part of a model"):
        model_directory(federation, "aggregator", tmp_path)
    serve = ["party", "serve", "--federation", str(path), "--wait", "1", "--name", "aggregator"]
    assert main([*serve, "--model-dir", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert "keeps no part of a model" in err and "serving at" not in out
    assert len(err.strip().splitlines()) == 1


def test_a_serving_process_takes_a_save_only_from_the_label_party_once_set_up(
    tmp_path: Path,
) -> None:
    federation = read_federation(write_federation(tmp_path, tmp_path, free_loopback_ports(5)))
    server = _Server(federation, "shop", None, lambda name: None, None, print)  # type: ignore[arg-type]
    refusals = {
        ("bank", "save"): "a save (run '0123456789abcdef0123456789abcdef') before the run was "
        "set up; only a set-up data party saves a part",
        ("insurer", "save"): "a deployment message ('save') from insurer, but its federation "
        "file names bank the label party, the only one that sets a run up or ends it: do the "
        "two parties' federation files differ?",
        ("bank", "saved"): "shop: a deployment message ('saved') from bank, which a data party "
        "does not take.",
    }
    for (sender, topic), reason in refusals.items():
        message = _deployment(sender, "shop", topic, {"run": RUN})
        with pytest.raises(ProtocolError, match=re.escape(reason)):
            server.receive(message)


@pytest.mark.parametrize(
    "flags",
    [
        ("--method", "laser", "--heads", "all"),
        ("--method", "false-vfl-2", "--labeled", "100", "--kappa", "3"),
    ],
    ids=["laser", "false-vfl-2"],
)
def test_a_data_party_predicts_only_with_its_own_unaltered_part_on_rows_it_holds(
    site: Path, tmp_path: Path, flags: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No processes: a served data party's `predict-setup`, fed the label party's message, with
    a part laid out as a deployed party keeps it (DIR/NAME/RUN_ID/): the models of its method
    (LASER's bottom and heads; FALSE-VFL's encoder, decoder and missingness model), loaded."""
    from secure_vfl import deployed_prediction
    from secure_vfl.deployed_prediction import _predict_setup, build_predicting_party

    in_process(site, tmp_path / "alone", *flags)
    manifest, directory = read_manifest(tmp_path / "alone")
    entry = manifest.parties[1]
    models = tmp_path / "models"
    shutil.copytree(directory / entry.directory, models / entry.name / manifest.run_id)
    names = [e.name for e in manifest.parties]
    table = read_party_file(site / "new" / "shop.csv")
    rows = np.array([2, -1, 0, 5])  # its rows of four predicted ids; it holds no second one
    body = _predict_setup(manifest, 1, names, rows)

    def build(change: dict[str, Any], model: Path | None = models) -> DataParty:
        message = _deployment("bank", entry.name, "predict-setup", {**body, **change})
        served = ServedModel(entry.name, model)
        return build_predicting_party(entry.name, message, table, served, lambda _: None)

    party = build({})
    block = party.block_rows("predict", torch.arange(4))
    assert block.shape == (4, *manifest.block_shapes[1]) and not block[1].any()
    in_memory = SavedModel.load(tmp_path / "alone")
    expected = in_process_parties(in_memory.channel)[1]
    expected.hold_rows("predict", table, rows, source="shop.csv")
    assert torch.equal(block, expected.block_rows("predict", torch.arange(4)))
    ours, theirs = party.own_modules(), expected.own_modules()
    assert ours.keys() == theirs.keys() and ours
    for key, module in ours.items():  # its loaded part: the trained weights, not the seed's
        loaded = theirs[key].state_dict()
        assert all(torch.equal(t, loaded[k]) for k, t in module.state_dict().items())
    for change, expected_error in [
        ({"run": "../../escape"}, "a run id of 32 hex digits expected"),
        ({"files": {"../weights.safetensors": "0" * 64}}, "per plain file name expected"),
        ({"files": {"00-bottom.safetensors": "xyz"}}, "per plain file name expected"),
        ({"rows": [table.ids.size]}, "must lie in [-1,"),
        ({"index": 2}, "expected at index 2"),
        ({"method": "mean"}, "a method of"),
        ({"block_shapes": body["block_shapes"][:2]}, "one block shape per party expected"),
        ({"method_config": {**body["method_config"], "representation_dim": 10**6}}, "at most"),
    ]:
        with pytest.raises(ProtocolError, match=re.escape(expected_error)):
            build(change)
    # A set-up that asks for a network its part does not hold (each size within its bounds) is
    # refused by the part's shapes, its models built only on torch's meta device.
    built_on: list[str] = []
    served_models = deployed_prediction.served_models

    def recording(*args: Any, **kwargs: Any) -> DataParty:
        built_on.append(torch.get_default_device().type)
        return served_models(*args, **kwargs)

    monkeypatch.setattr(deployed_prediction, "served_models", recording)
    shapes = [body["block_shapes"][0], [2**20], *body["block_shapes"][2:]]
    with pytest.raises(ProtocolError, match="does not fit the architecture the manifest"):
        build({"block_shapes": shapes})
    assert built_on == ["meta"]
    built_on.clear()
    build({})
    assert built_on == ["meta", "cpu"]
    with pytest.raises(ProtocolError, match="keeps no model directory"):
        build({}, model=None)
    with pytest.raises(ProtocolError, match="cannot load its part of model"):
        build({"run": "0" * 32})  # a model it keeps no part of
    [weights, *_] = sorted((models / entry.name / manifest.run_id).glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes() + b"\0")
    with pytest.raises(ProtocolError, match="does not match the SHA-256"):
        build({})


def test_a_deployed_prediction_refuses_what_does_not_fit_before_any_contact(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    in_process(site, tmp_path / "alone", "--method", "laser")
    federation = write_federation(site, site / "certs", [1, 2, 3, 4, 5])
    base = ["predict", "--model", str(tmp_path / "alone"), "--out", str(tmp_path / "p.csv")]
    deployed = [*base, "--federation", str(federation), "--wait", "1"]
    new = [str(site / "new" / f"{n}.csv") for n in PARTIES]
    cases = [
        (deployed, "--federation needs --name NAME"),
        ([*deployed, "--name", "shop"], "shop is not the label party"),
        (
            [*deployed, "--name", "bank", "--party-file", new[0], "--party-file", new[1]],
            "with --federation at most one --party-file",
        ),
        (
            [*deployed, "--name", "bank", "--party-file", f"shop={new[1]}"],
            "the label party's own new rows",
        ),
        # Trained in one process, under other names: the federation's parties hold no part.
        ([*deployed, "--name", "bank"], "was trained by party-0, party-1"),
        (base, "predict needs --party-file"),
        ([*base, "--party-file", new[0], "--name", "bank"], "--name goes with --federation"),
        ([*base, "--party-file", new[0], "--align", "psi"], "--align psi goes with --federation"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "p.csv").exists()
