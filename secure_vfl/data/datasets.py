"""The offline dataset registry: labelled train/test arrays from files that ship in packages.

Nothing is downloaded at run time. scikit-learn's bundled datasets are always there; the others
come from Debian packages that ``install_dataset`` fetches with ``apt-get download`` and unpacks
with ``dpkg -x`` under ``data_home()/"debian"`` (a system-wide ``apt-get install`` works too).
The R datasets are GPL: they are read where they were unpacked and never copied into the repo.
"""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pandas as pd

from secure_vfl.data.preprocessing import stratified_split
from secure_vfl.errors import DataError, DatasetNotInstalledError
from secure_vfl.registry import Registry

Kind = Literal["tabular", "image"]

_SYSTEM_ROOT = Path("/")
"""Where ``apt-get install`` puts package files; a second place to look for Debian datasets."""

TEST_FRACTION = 0.2
"""Share of rows held out for testing when a dataset has no official split."""


@dataclass(frozen=True)
class LabeledArrays:
    """Features ``x`` (float32, ``(N, D)`` or ``(N, C, H, W)``) and labels ``y`` (int64, 0..C-1)."""

    x: np.ndarray
    y: np.ndarray

    def __post_init__(self) -> None:
        if self.x.dtype != np.float32 or self.x.ndim not in (2, 4):
            raise DataError(
                "`x` must be float32 of shape (N, D) or (N, C, H, W). "
                f"Found {self.x.dtype} of shape {self.x.shape}."
            )
        if self.y.dtype != np.int64 or self.y.shape != (self.x.shape[0],):
            raise DataError(
                f"`y` must be int64 of shape ({self.x.shape[0]},). "
                f"Found {self.y.dtype} of shape {self.y.shape}."
            )
        if self.y.size and int(self.y.min()) < 0:
            raise DataError(f"labels must be >= 0. Found {int(self.y.min())}.")

    def __len__(self) -> int:
        return int(self.x.shape[0])


@dataclass(frozen=True)
class DatasetSplit:
    """A dataset's train and test arrays with what is needed to partition and train on them."""

    name: str
    kind: Kind
    train: LabeledArrays
    test: LabeledArrays
    num_classes: int
    feature_names: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("tabular", "image"):
            raise DataError(f"`kind` must be 'tabular' or 'image'. Found {self.kind!r}.")
        expected_ndim = 2 if self.kind == "tabular" else 4
        for part, arrays in (("train", self.train), ("test", self.test)):
            if arrays.x.ndim != expected_ndim:
                raise DataError(
                    f"{self.kind} `{part}.x` must have {expected_ndim} dimensions. "
                    f"Found shape {arrays.x.shape}."
                )
        if self.train.x.shape[1:] != self.test.x.shape[1:]:
            raise DataError(
                "train and test features must have the same shape per sample. "
                f"Found {self.train.x.shape[1:]} and {self.test.x.shape[1:]}."
            )
        if self.num_classes < 2:
            raise DataError(f"`num_classes` must be >= 2. Found {self.num_classes}.")
        for part, arrays in (("train", self.train), ("test", self.test)):
            if arrays.y.size and int(arrays.y.max()) >= self.num_classes:
                raise DataError(
                    f"`{part}.y` must be in 0..{self.num_classes - 1}. Found {int(arrays.y.max())}."
                )
        if self.feature_names is not None and len(self.feature_names) != self.train.x.shape[1]:
            raise DataError(
                f"`feature_names` must name the {self.train.x.shape[1]} columns. "
                f"Found {len(self.feature_names)} names."
            )


@dataclass(frozen=True)
class DatasetSpec:
    """A registered dataset: where it comes from, which files it needs and how to load it."""

    name: str
    description: str
    kind: Kind
    source: str
    debian_packages: tuple[str, ...]
    shape: str
    loader: Callable[[np.random.Generator], DatasetSplit]
    files: Callable[[], list[Path]]

    def is_installed(self) -> bool:
        """True when every file the loader needs exists on this machine."""
        return all(path.is_file() for path in self.files())

    def install_hint(self) -> str:
        """One line telling the user how to make this dataset available."""
        if not self.debian_packages:
            return f"{self.source}; nothing to install."
        return f"secure-vfl datasets install {self.name}"


DATASETS: Registry[DatasetSpec] = Registry("dataset")
"""Every dataset the CLI and experiments can select by name."""


def data_home() -> Path:
    """Where secure-vfl keeps data: ``$SECURE_VFL_DATA``, else ``$XDG_DATA_HOME/secure-vfl``,
    else ``~/.local/share/secure-vfl``."""
    explicit = os.environ.get("SECURE_VFL_DATA")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "share"
    return base / "secure-vfl"


def debian_files(relative: tuple[str, ...]) -> list[Path]:
    """The package files under the first root holding all of them (``data_home()/debian``, then
    the system root); the ``data_home`` paths when neither does, so errors show where to put them.
    """
    roots = [data_home() / "debian", _SYSTEM_ROOT]
    for root in roots:
        paths = [root / rel for rel in relative]
        if all(path.is_file() for path in paths):
            return paths
    return [roots[0] / rel for rel in relative]


def _split_with_rng(
    name: str,
    x: np.ndarray,
    y: np.ndarray,
    num_classes: int,
    rng: np.random.Generator,
    feature_names: tuple[str, ...] | None,
) -> DatasetSplit:
    """A seeded stratified 80/20 split for datasets without an official one."""
    train, test = stratified_split(y, TEST_FRACTION, rng=rng)
    return DatasetSplit(
        name=name,
        kind="tabular",
        train=LabeledArrays(x[train], y[train]),
        test=LabeledArrays(x[test], y[test]),
        num_classes=num_classes,
        feature_names=feature_names,
    )


def _sklearn_loader(name: str, function: str) -> Callable[[np.random.Generator], DatasetSplit]:
    """A loader calling ``sklearn.datasets.<function>`` (imported on use: it is slow to import)."""

    def loader(rng: np.random.Generator) -> DatasetSplit:
        from sklearn import datasets as sklearn_datasets

        bunch: Any = getattr(sklearn_datasets, function)()
        x = np.asarray(bunch.data, dtype=np.float32)
        y = np.asarray(bunch.target, dtype=np.int64)
        names = tuple(str(n) for n in bunch.feature_names)
        return _split_with_rng(name, x, y, int(y.max()) + 1, rng, names)

    return loader


def _register_sklearn() -> None:
    """Register the datasets that ship inside scikit-learn."""
    bundled = (
        (
            "digits",
            "8x8 handwritten digits, pixel intensities 0-16 as 64 columns",
            "load_digits",
            "1797 x 64, 10 classes",
        ),
        (
            "breast-cancer",
            "Wisconsin diagnostic breast cancer, malignant vs benign",
            "load_breast_cancer",
            "569 x 30, 2 classes",
        ),
        (
            "wine",
            "chemical analysis of wines from three cultivars",
            "load_wine",
            "178 x 13, 3 classes",
        ),
        ("iris", "Fisher's iris flowers", "load_iris", "150 x 4, 3 classes"),
    )
    for name, description, load, shape in bundled:
        DATASETS.register(
            name,
            DatasetSpec(
                name=name,
                description=description,
                kind="tabular",
                source="scikit-learn bundled",
                debian_packages=(),
                shape=shape,
                loader=_sklearn_loader(name, load),
                files=list,
            ),
        )


FASHION_MNIST_DIR = "usr/share/datasets/fashion-mnist"
_FASHION_FILES = (
    f"{FASHION_MNIST_DIR}/train-images-idx3-ubyte.gz",
    f"{FASHION_MNIST_DIR}/train-labels-idx1-ubyte.gz",
    f"{FASHION_MNIST_DIR}/t10k-images-idx3-ubyte.gz",
    f"{FASHION_MNIST_DIR}/t10k-labels-idx1-ubyte.gz",
)
_IDX_IMAGES_MAGIC = 2051
_IDX_LABELS_MAGIC = 2049


def read_idx_gz(path: Path) -> np.ndarray:
    """Read a gzip-compressed idx file (MNIST format) of unsigned bytes into a uint8 array."""
    with gzip.open(path, "rb") as handle:
        raw = handle.read()
    if len(raw) < 8:
        raise DataError(f"{path} must be an idx file. Found only {len(raw)} bytes.")
    magic = int.from_bytes(raw[:4], "big")
    if magic not in (_IDX_IMAGES_MAGIC, _IDX_LABELS_MAGIC):
        raise DataError(
            f"{path} must start with idx magic {_IDX_LABELS_MAGIC} or {_IDX_IMAGES_MAGIC}. "
            f"Found {magic}."
        )
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    dims = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    expected = int(np.prod(dims))
    if len(raw) - header != expected:
        raise DataError(
            f"{path} declares shape {dims} ({expected} bytes). Found {len(raw) - header} bytes."
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def _load_fashion_mnist(rng: np.random.Generator) -> DatasetSplit:
    """The official 60k/10k split, images scaled to [0, 1] with shape (N, 1, 28, 28)."""
    del rng  # the split is fixed
    train_x, train_y, test_x, test_y = (read_idx_gz(p) for p in debian_files(_FASHION_FILES))

    def arrays(images: np.ndarray, labels: np.ndarray) -> LabeledArrays:
        x = (images.astype(np.float32) / 255.0)[:, None, :, :]
        return LabeledArrays(x, labels.astype(np.int64))

    return DatasetSplit(
        name="fashion-mnist",
        kind="image",
        train=arrays(train_x, train_y),
        test=arrays(test_x, test_y),
        num_classes=10,
    )


def read_rda(path: Path, object_name: str) -> pd.DataFrame:
    """Read one data frame from an R data file with ``rdata`` (no R needed)."""
    import rdata

    try:
        with warnings.catch_warnings():
            # R's data files from Debian carry no encoding tag; rdata assumes ASCII and says so.
            warnings.filterwarnings("ignore", message="Unknown encoding", category=UserWarning)
            objects = rdata.read_rda(path)
    except Exception as error:  # rdata, lzma, gzip and bz2 raise many kinds on damaged input
        first = str(error).strip().splitlines()[0][:120] if str(error).strip() else ""
        raise DataError(
            f"{path} must be an R data file; it cannot be read ({type(error).__name__}: "
            f"{first}): damaged or cut short. Remove it and install its dataset again "
            "(`secure-vfl datasets install NAME`)."
        ) from None
    frame = objects.get(object_name)
    if not isinstance(frame, pd.DataFrame):
        raise DataError(
            f"{path} must hold a data frame named {object_name!r}. "
            f"Found objects: {sorted(objects)}."
        )
    return frame


_SATELLITE_FILE = "usr/lib/R/site-library/mlbench/data/Satellite.rda"
SATELLITE_TRAIN_ROWS = 4435
"""The Statlog split: the first 4435 rows are the training set, the last 2000 the test set."""


def _load_satellite(rng: np.random.Generator) -> DatasetSplit:
    """Landsat multispectral pixels (Statlog), 36 features, 6 soil/crop classes."""
    del rng  # the split is fixed
    (path,) = debian_files((_SATELLITE_FILE,))
    frame = read_rda(path, "Satellite")
    if "classes" not in frame.columns or frame.shape != (6435, 37):
        raise DataError(
            f"{path} must hold 6435 rows of 36 features and a `classes` column. "
            f"Found shape {frame.shape} with columns {list(frame.columns)[:5]}..."
        )
    classes = frame["classes"].astype("category")
    y = classes.cat.codes.to_numpy().astype(np.int64)
    features = frame.drop(columns="classes")
    x = features.to_numpy(dtype=np.float32)
    cut = SATELLITE_TRAIN_ROWS
    return DatasetSplit(
        name="satellite",
        kind="tabular",
        train=LabeledArrays(x[:cut], y[:cut]),
        test=LabeledArrays(x[cut:], y[cut:]),
        num_classes=len(classes.cat.categories),
        feature_names=tuple(str(c) for c in features.columns),
    )


_GERMAN_CREDIT_FILE = "usr/lib/R/site-library/caret/data/GermanCredit.RData"


def _load_german_credit(rng: np.random.Generator) -> DatasetSplit:
    """German credit (caret's dummy-coded version): label ``Class`` Good -> 1, Bad -> 0."""
    (path,) = debian_files((_GERMAN_CREDIT_FILE,))
    frame = read_rda(path, "GermanCredit")
    if "Class" not in frame.columns:
        raise DataError(f"{path} must have a `Class` column. Found {list(frame.columns)[:5]}...")
    label_text = frame["Class"].astype(str)
    unknown = sorted(set(label_text) - {"Good", "Bad"})
    if unknown:
        raise DataError(f"`Class` in {path} must be Good or Bad. Found {unknown}.")
    y = (label_text == "Good").to_numpy().astype(np.int64)
    features = frame.drop(columns="Class")
    x = features.astype("float64").to_numpy(dtype=np.float32, na_value=np.nan)
    if not np.isfinite(x).all():
        raise DataError(f"{path} must have finite features. Found {int((~np.isfinite(x)).sum())}.")
    return _split_with_rng("german-credit", x, y, 2, rng, tuple(str(c) for c in features.columns))


def _register_debian() -> None:
    """Register the datasets unpacked from Debian packages."""
    DATASETS.register(
        "fashion-mnist",
        DatasetSpec(
            name="fashion-mnist",
            description="Zalando article images, 28x28 grey levels; FALSE-VFL's image benchmark",
            kind="image",
            source="Debian package dataset-fashion-mnist",
            debian_packages=("dataset-fashion-mnist",),
            shape="60000 + 10000 x 1x28x28, 10 classes",
            loader=_load_fashion_mnist,
            files=lambda: debian_files(_FASHION_FILES),
        ),
    )
    DATASETS.register(
        "satellite",
        DatasetSpec(
            name="satellite",
            description="Statlog Landsat satellite pixels (mlbench::Satellite), GPL",
            kind="tabular",
            source="Debian package r-cran-mlbench",
            debian_packages=("r-cran-mlbench",),
            shape="4435 + 2000 x 36, 6 classes",
            loader=_load_satellite,
            files=lambda: debian_files((_SATELLITE_FILE,)),
        ),
    )
    DATASETS.register(
        "german-credit",
        DatasetSpec(
            name="german-credit",
            description="Statlog German credit, dummy-coded (caret::GermanCredit), GPL",
            kind="tabular",
            source="Debian package r-cran-caret",
            debian_packages=("r-cran-caret",),
            shape="1000 x 61, 2 classes",
            loader=_load_german_credit,
            files=lambda: debian_files((_GERMAN_CREDIT_FILE,)),
        ),
    )


_register_sklearn()
_register_debian()


def load_dataset(name: str, *, rng: np.random.Generator) -> DatasetSplit:
    """Load a registered dataset; ``rng`` draws the split of datasets without an official one."""
    spec = DATASETS.get(name)
    require_installed(name, spec.files())
    return spec.loader(rng)


def require_installed(name: str, files: list[Path]) -> None:
    """Raise :class:`DatasetNotInstalledError` naming the missing files and the install command
    when any of dataset ``name``'s ``files`` is absent."""
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise DatasetNotInstalledError(
            f"dataset {name!r} is not installed: expected {', '.join(missing)}. "
            f"Install it with `secure-vfl datasets install {name}`."
        )


def dataset_status() -> list[tuple[DatasetSpec, bool]]:
    """Every registered dataset with whether its files are on this machine, sorted by name."""
    return [(DATASETS.get(name), DATASETS.get(name).is_installed()) for name in DATASETS.names()]


def _run(command: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run a command, capturing its output; a missing executable is a DataError."""
    try:
        return subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)
    except FileNotFoundError as error:
        raise DataError(
            f"`{command[0]}` must be available to install Debian dataset packages. Found none "
            f"({error}). On a system without apt, unpack the package into {data_home() / 'debian'}."
        ) from None


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def _tail(text: str, lines: int = 5) -> str:
    return " | ".join(text.strip().splitlines()[-lines:])


def install_dataset(name: str, *, log: Callable[[str], None] = print) -> None:
    """Fetch and unpack the Debian packages of dataset ``name`` under ``data_home()/debian``.

    A no-op when the dataset is installed or bundled. As root a failed download triggers one
    ``apt-get update`` and a retry; otherwise the error says which commands to run.
    """
    spec = DATASETS.get(name)
    install_debian_dataset(name, spec.debian_packages, spec.files, log=log)


def install_debian_dataset(
    name: str,
    debian_packages: Sequence[str],
    files: Callable[[], list[Path]],
    *,
    log: Callable[[str], None] = print,
) -> None:
    """Unpack ``debian_packages`` under ``data_home()/debian`` until all of ``files()`` exist.

    The install step of every registry (classification and imputation datasets); see
    :func:`install_dataset` for the behaviour.
    """
    if all(path.is_file() for path in files()):
        log(f"{name}: already installed.")
        return
    target = data_home() / "debian"
    target.mkdir(parents=True, exist_ok=True)
    updated = False
    for package in debian_packages:
        with tempfile.TemporaryDirectory(prefix="secure-vfl-deb-") as tmp:
            workdir = Path(tmp)
            log(f"{name}: apt-get download {package}")
            result = _run(["apt-get", "download", package], cwd=workdir)
            if result.returncode != 0 and _is_root() and not updated:
                log(f"{name}: download failed; running apt-get update once and retrying")
                _run(["apt-get", "update"])
                updated = True
                result = _run(["apt-get", "download", package], cwd=workdir)
            if result.returncode != 0:
                how = "" if _is_root() else "sudo "
                raise DataError(
                    f"`apt-get download {package}` must succeed to install {name!r}. Found exit "
                    f"code {result.returncode}: {_tail(result.stderr)}. Run `{how}apt-get update` "
                    f"and then `secure-vfl datasets install {name}`, or install it system-wide "
                    f"with `{how}apt-get install {package}`."
                )
            debs = sorted(workdir.glob("*.deb"))
            if len(debs) != 1:
                raise DataError(
                    f"`apt-get download {package}` must produce one .deb file. "
                    f"Found {[d.name for d in debs]}."
                )
            log(f"{name}: dpkg -x {debs[0].name} {target}")
            # Unpacked beside the data, then each file moved into place whole: an unpack that
            # is stopped or runs out of disk leaves no file cut short that counts as installed.
            staging = Path(tempfile.mkdtemp(prefix=".unpacking-", dir=data_home()))
            try:
                unpacked = _run(["dpkg", "-x", str(debs[0]), str(staging)])
                if unpacked.returncode != 0:
                    raise DataError(
                        f"`dpkg -x {debs[0].name}` must unpack into {target}. Found exit code "
                        f"{unpacked.returncode}: {_tail(unpacked.stderr)}."
                    )
                _move_into(staging, target)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    missing = [str(p) for p in files() if not p.is_file()]
    if missing:
        raise DataError(
            f"after unpacking {', '.join(debian_packages)}, {name!r} must have its files. "
            f"Found these missing: {', '.join(missing)}."
        )
    log(f"{name}: installed under {target}.")


def _move_into(source: Path, target: Path) -> None:
    """Move every file under ``source`` to the same place under ``target`` (on one file system:
    each appears whole, by one rename), replacing what is there; links move as links."""
    for path in sorted(source.rglob("*")):
        if path.is_dir() and not path.is_symlink():
            continue
        destination = target / path.relative_to(source)
        destination.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, destination)


def install_all(*, log: Callable[[str], None] = print) -> list[str]:
    """Install every registered dataset that is not installed yet; return the names installed."""
    installed: list[str] = []
    for spec, present in dataset_status():
        if not present:
            install_dataset(spec.name, log=log)
            installed.append(spec.name)
    return installed
