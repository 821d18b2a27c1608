"""The data pipeline every method uses: partition, standardise, mask, zero-fill, drop.

Each party's block is standardised with that block's training statistics only. Train and test
masks are drawn independently, one test split per requested test mechanism. Unobserved entries
are zero and must never be read; samples with no observed block are dropped and counted
(DESIGN §5).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from secure_vfl.data.datasets import DatasetSplit, Kind
from secure_vfl.data.missingness import Mechanism, drop_unobserved
from secure_vfl.data.partition import column_ranges, left_out_columns, partition
from secure_vfl.data.party_files import (
    ID_COLUMN,
    LABEL_COLUMN,
    LabelTable,
    PartyTable,
    check_party_tables,
    describe_unmatched,
    near_matches,
    read_label_file,
    read_party_file,
)
from secure_vfl.data.party_files import party_names as party_names_of
from secure_vfl.data.party_preprocessing import DEFAULT_MISSING_POLICY, PartyPreprocessing
from secure_vfl.data.preprocessing import Standardizer, stratified_split
from secure_vfl.errors import ConfigError, DataError, RunWarning

if TYPE_CHECKING:  # only a type here; keeps data importable without the federation package
    from secure_vfl.federation.alignment import Aligner, Alignment


@dataclass(frozen=True)
class VerticalSplit:
    """K feature blocks of the same N samples, their labels and availability mask.

    ``blocks[k]`` is float32 (N, ...); rows where ``mask[:, k]`` is False are zero and carry no
    data. ``labels`` int64 (N,); ``mask`` bool (N, K).
    """

    blocks: tuple[np.ndarray, ...]
    labels: np.ndarray
    mask: np.ndarray

    def __post_init__(self) -> None:
        n = self.labels.shape[0]
        if self.labels.dtype != np.int64 or self.labels.ndim != 1:
            raise DataError(
                "`labels` must be int64 of shape (N,). "
                f"Found {self.labels.dtype} {self.labels.shape}."
            )
        if self.mask.dtype != np.bool_ or self.mask.shape != (n, len(self.blocks)):
            raise DataError(
                f"`mask` must be bool of shape ({n}, {len(self.blocks)}). "
                f"Found {self.mask.dtype} {self.mask.shape}."
            )
        for k, block in enumerate(self.blocks):
            if block.dtype != np.float32 or block.shape[0] != n:
                raise DataError(
                    f"block {k} must be float32 with {n} rows. Found {block.dtype} {block.shape}."
                )

    @property
    def n(self) -> int:
        """Number of samples."""
        return int(self.labels.shape[0])

    @property
    def parties(self) -> int:
        """Number of feature blocks K."""
        return len(self.blocks)

    def subset(self, index: np.ndarray) -> VerticalSplit:
        """The samples at ``index`` (integer indices or a bool row mask), in that order."""
        return VerticalSplit(
            blocks=tuple(block[index] for block in self.blocks),
            labels=self.labels[index],
            mask=self.mask[index],
        )


@dataclass(frozen=True)
class VerticalData:
    """A vertically partitioned dataset: the training split and one test split per test
    mechanism label (e.g. ``"mcar:0.5"``).

    ``dropped`` counts samples removed for having no observed block, keyed ``"train"`` and by
    test label; data from party files also has ``"alignment"`` (labels no party holds).
    ``feature_names`` gives each block's column names where known (tabular data), and
    ``left_out_columns`` the names of the dataset's columns that no block holds: the last
    D mod K, which equal blocks leave out as both papers do (:func:`column_blocks
    <secure_vfl.data.partition.column_blocks>`).
    ``preprocessing[k]`` is party k's own column schema and training standardisation (what its
    saved model keeps; None where a view holds only its own), and ``classes`` the original label
    value of each class index (the label file's own values; 0..C-1 for a registered dataset).
    ``party_names`` are the users' names of the parties (the files' stems or ``--party-name``;
    None for a registered dataset, whose parties are ``party-0``...) and ``alignment`` the
    alignment report of party files (:func:`alignment_report`). ``aligned_rows`` are the
    training rows kept observed by every party whatever the training missingness (sorted; a
    reserve of labelled samples, :func:`make_vertical`'s ``aligned``; None: no reserve).
    """

    name: str
    kind: Kind
    num_classes: int
    train: VerticalSplit
    tests: dict[str, VerticalSplit]
    dropped: dict[str, int]
    feature_names: tuple[tuple[str, ...], ...] | None = None
    left_out_columns: tuple[str, ...] = ()
    preprocessing: tuple[PartyPreprocessing | None, ...] | None = None
    classes: tuple[object, ...] | None = None
    party_names: tuple[str, ...] | None = None
    alignment: dict[str, Any] | None = None
    aligned_rows: np.ndarray | None = None

    @property
    def parties(self) -> int:
        """Number of feature blocks K."""
        return self.train.parties

    @property
    def block_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Per-sample shape of each party's block, e.g. ``((1, 14, 7), ...)`` or ``((16,),)``."""
        return tuple(tuple(block.shape[1:]) for block in self.train.blocks)


def _masked_split(
    blocks: Sequence[np.ndarray], labels: np.ndarray, mask: np.ndarray, *, copy: bool
) -> tuple[VerticalSplit, int]:
    """Zero-fill unobserved entries (in place unless ``copy``, for blocks that several test
    splits share) and drop samples with no observed block."""
    filled = []
    for k, block in enumerate(blocks):
        block = block.copy() if copy else block
        block[~mask[:, k]] = 0.0
        filled.append(block)
    keep, dropped = drop_unobserved(mask)
    split = VerticalSplit(blocks=tuple(filled), labels=labels, mask=mask)
    return (split if dropped == 0 else split.subset(keep)), dropped


def _warn_all_observed(
    mechanism: Mechanism, mask: np.ndarray, blocks: Sequence[np.ndarray], split: str
) -> None:
    """Warn (:class:`RunWarning`) when ``mechanism``, which asks for missing blocks, drew a
    ``mask`` of the ``split`` samples that observes every block: the split is then that of
    ``mcar:0`` under another name. The MAR rules (FALSE-VFL appendix D.4) draw it from blocks
    of one column each with the paper's thresholds and up to 9 (mar1) or 7 (mar2) blocks: such a
    block's variance is 0, which ends a sample's visit only once the threshold has dropped below
    0, and every block a sample visits is observed."""
    if mechanism.asks_for_none or mask.size == 0 or not mask.all():
        return
    samples = f"{mask.shape[0]} {split} sample" + ("s" if mask.shape[0] != 1 else "")
    message = (
        f"the {split} missingness {mechanism.label} left every block of all {samples} "
        "observed, as mcar:0 would"
    )
    one_column = all(int(np.prod(block.shape[1:])) == 1 for block in blocks)
    if mechanism.name in ("mar1", "mar2") and one_column:
        message += (
            f": each of the {len(blocks)} blocks has one column, whose variance within the "
            f"block is 0 for every sample, too little for {mechanism.name} to end any "
            "sample's visit before its last block, and every visited block is observed (MAR "
            "needs blocks of several columns: fewer parties)"
        )
    warnings.warn(message + ".", RunWarning, stacklevel=2)


def _check_test_labels(test_missing: Sequence[Mechanism]) -> None:
    labels = [m.label for m in test_missing]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ConfigError(f"test mechanisms must be distinct. Found repeated {repeated}.")


def _standardise(
    train_blocks: Sequence[np.ndarray],
    test_blocks: Sequence[np.ndarray],
    train_rows: Sequence[np.ndarray | None],
) -> tuple[list[np.ndarray], list[np.ndarray], list[Standardizer]]:
    """Standardise each party's train and test block with its own observed training rows;
    also return each party's fitted scaler (kept in its saved model)."""
    scaled_train, scaled_test, scalers = [], [], []
    for train, test, rows in zip(train_blocks, test_blocks, train_rows, strict=True):
        scaler = Standardizer().fit(train, rows)
        scaled_train.append(scaler.transform(train))
        scaled_test.append(scaler.transform(test))
        scalers.append(scaler)
    return scaled_train, scaled_test, scalers


def _preprocessing(
    scalers: Sequence[Standardizer], names: tuple[tuple[str, ...], ...] | None
) -> tuple[PartyPreprocessing, ...]:
    return tuple(
        PartyPreprocessing.from_standardizer(scaler, columns=None if names is None else names[k])
        for k, scaler in enumerate(scalers)
    )


def _assemble(
    *,
    name: str,
    kind: Kind,
    num_classes: int,
    train_blocks: Sequence[np.ndarray],
    train_labels: np.ndarray,
    test_blocks: Sequence[np.ndarray],
    test_labels: np.ndarray,
    train_missing: Mechanism,
    test_missing: Sequence[Mechanism],
    rng: np.random.Generator,
    held_train: np.ndarray | None = None,
    held_test: np.ndarray | None = None,
    feature_names: tuple[tuple[str, ...], ...] | None = None,
    left_out_columns: tuple[str, ...] = (),
    dropped: dict[str, int] | None = None,
    preprocessing: tuple[PartyPreprocessing, ...] | None = None,
    classes: tuple[object, ...] | None = None,
    party_names: tuple[str, ...] | None = None,
    alignment: dict[str, Any] | None = None,
    aligned: np.ndarray | None = None,
) -> VerticalData:
    """Draw the masks (AND-ed with which rows parties hold, if given) and build the splits;
    the training rows ``aligned`` stay observed by every party."""
    dropped = dict(dropped or {})
    train_mask = train_missing.sample(train_blocks, rng=rng)
    _warn_all_observed(train_missing, train_mask, train_blocks, "training")
    if held_train is not None:
        train_mask &= held_train
    aligned_rows = None
    if aligned is not None:
        train_mask[aligned] = True
        # Their rows once the samples no party observes are dropped (they are not among them).
        aligned_rows = np.flatnonzero(np.isin(np.flatnonzero(train_mask.any(axis=1)), aligned))
    train, dropped["train"] = _masked_split(train_blocks, train_labels, train_mask, copy=False)
    tests: dict[str, VerticalSplit] = {}
    for mechanism in test_missing:
        test_mask = mechanism.sample(test_blocks, rng=rng)
        _warn_all_observed(mechanism, test_mask, test_blocks, "test")
        if held_test is not None:
            test_mask &= held_test
        tests[mechanism.label], dropped[mechanism.label] = _masked_split(
            test_blocks, test_labels, test_mask, copy=True
        )
    return VerticalData(
        name=name,
        kind=kind,
        num_classes=num_classes,
        train=train,
        tests=tests,
        dropped=dropped,
        feature_names=feature_names,
        left_out_columns=left_out_columns,
        preprocessing=preprocessing,
        classes=classes if classes is not None else tuple(range(num_classes)),
        party_names=party_names,
        alignment=alignment,
        aligned_rows=aligned_rows,
    )


def make_vertical(
    split: DatasetSplit,
    *,
    parties: int,
    train_missing: Mechanism,
    test_missing: Sequence[Mechanism],
    rng: np.random.Generator,
    aligned: int = 0,
    aligned_rng: np.random.Generator | None = None,
) -> VerticalData:
    """Partition a dataset over ``parties`` (column blocks or image patches), standardise each
    block with its training statistics, and draw independent train and test masks. The columns
    that equal blocks leave out are named in ``left_out_columns``.

    The MAR/MNAR rules see the standardised blocks, as in FALSE-VFL's appendix D.4. ``aligned``
    training samples, drawn uniformly by ``aligned_rng`` (its own stream: the masks are those of
    a run without them), are kept observed by every party and the training missingness renders
    only the others missing: FALSE-VFL's setup, which reserves 100 (tabular) or 200 (image) of
    its labelled samples as fully aligned (its section 5); :func:`labeled_rows
    <secure_vfl.methods.base.labeled_rows>` labels them first (``VerticalData.aligned_rows``).
    """
    _check_test_labels(test_missing)
    reserve = None
    if aligned:
        n = split.train.y.shape[0]
        if isinstance(aligned, bool) or not isinstance(aligned, int) or not 0 <= aligned <= n:
            raise ConfigError(
                f"`aligned_labeled` must be an integer in [0, {n}] (the training samples). "
                f"Found {aligned!r}."
            )
        if aligned_rng is None:
            raise ConfigError("`aligned` samples need their own generator: give aligned_rng.")
        reserve = np.sort(aligned_rng.choice(n, size=aligned, replace=False))
    train_raw = partition(split.train.x, split.kind, parties)
    test_raw = partition(split.test.x, split.kind, parties)
    train_blocks, test_blocks, scalers = _standardise(train_raw, test_raw, [None] * parties)
    names = None
    left_out: tuple[str, ...] = ()
    if split.feature_names is not None:
        width = len(split.feature_names)
        names = tuple(
            tuple(split.feature_names[c] for c in columns)
            for columns in column_ranges(width, parties)
        )
        left_out = tuple(split.feature_names[c] for c in left_out_columns(width, parties))
    return _assemble(
        name=split.name,
        kind=split.kind,
        num_classes=split.num_classes,
        train_blocks=train_blocks,
        train_labels=split.train.y,
        test_blocks=test_blocks,
        test_labels=split.test.y,
        train_missing=train_missing,
        test_missing=test_missing,
        rng=rng,
        feature_names=names,
        preprocessing=_preprocessing(scalers, names),
        left_out_columns=left_out,
        aligned=reserve,
    )


def vertical_from_party_files(
    party_files: Sequence[Path],
    label_file: Path,
    *,
    aligner: Aligner,
    train_missing: Mechanism,
    test_missing: Sequence[Mechanism],
    test_fraction: float = 0.2,
    test_file: Path | None = None,
    rng: np.random.Generator,
    id_column: str = ID_COLUMN,
    label_column: str = LABEL_COLUMN,
    missing_cells: str = DEFAULT_MISSING_POLICY,
    party_names: Sequence[str] | None = None,
    cross_party_counts: bool = True,
) -> VerticalData:
    """Build vertical data from one file per party and a label file.

    Samples are aligned on the ids of ``id_column`` by ``aligner``; a party's block is zero
    where it does not hold a sample. The test rows are the ids of ``test_file`` (a label file of
    held-out ids whose features come from the same party files), or else a stratified, seeded
    ``test_fraction`` of the label file's rows. Each party fits its own preprocessing
    (:class:`PartyPreprocessing`: one-hot encoding, the ``missing_cells`` policy,
    standardisation) on the training rows it holds; the mask is the alignment mask AND the
    mechanism's mask. ``party_names`` name the parties (default: the files' stems, made safe);
    the alignment report counts ids across parties only if ``cross_party_counts`` (a plain
    join, which sees every id; PSI does not).
    """
    _check_test_labels(test_missing)
    if len(party_files) == 0:
        raise ConfigError("expected at least one party file. Found none.")
    paths = [Path(path) for path in party_files]
    names = party_names_of(paths, party_names)
    tables = [
        read_party_file(path, id_column=id_column, name=name)
        for path, name in zip(paths, names, strict=True)
    ]
    label_table = read_label_file(Path(label_file), id_column=id_column, label_column=label_column)
    label_ids, all_labels, held_out = label_table.ids, label_table.labels, None
    if test_file is not None:
        test_table = read_label_file(
            Path(test_file), id_column=id_column, label_column=label_column, held_out=True
        )
        label_ids, all_labels, held_out = _with_held_out(
            label_table, test_table, label_file, test_file
        )
    check_party_tables(tables, paths, label_table, Path(label_file), label_column=label_column)
    alignment = aligner.align([table.ids for table in tables], label_ids)
    for k, table in enumerate(tables):
        if not alignment.mask[:, k].any():
            raise DataError(describe_unmatched(table, paths[k], label_table, Path(label_file)))
        if cross_party_counts:  # a plain join sees every id (PSI shows no party the others')
            _warn_near_matches(table.ids, label_ids, paths[k], Path(label_file))
    # Each party knows how many of its own rows found no label (under PSI too).
    unlabelled = sum(
        table.ids.size - int(alignment.mask[:, k].sum()) for k, table in enumerate(tables)
    )
    labels = all_labels[alignment.label_rows]
    train_index, test_index = _train_test_indices(
        labels, alignment, label_table, held_out, test_fraction, test_file, rng
    )
    held_train = alignment.mask[train_index]
    held_test = alignment.mask[test_index]
    train_blocks: list[np.ndarray] = []
    test_blocks: list[np.ndarray] = []
    preprocessing: list[PartyPreprocessing] = []
    for k, table in enumerate(tables):
        if not held_train[:, k].any():
            split = (
                f"test_fraction {test_fraction} (--test-fraction) left {train_index.size} of "
                f"{labels.size} aligned rows for training"
                if test_file is None
                else f"{train_index.size} aligned rows are not the test file's"
            )
            raise DataError(
                f"party {table.name!r} ({paths[k]}) holds no training sample ({split}); cannot "
                "fit its preprocessing."
            )
        train_rows = alignment.rows[train_index, k]
        blocks, fitted = party_blocks(
            table,
            train_rows[held_train[:, k]],
            {"train": train_rows, "test": alignment.rows[test_index, k]},
            missing_cells=missing_cells,
            id_column=id_column,
            where=f"{paths[k]} ({table.name})",
        )
        preprocessing.append(fitted)
        train_blocks.append(blocks["train"])
        test_blocks.append(blocks["test"])
    report = alignment_report(
        tables,
        paths,
        alignment.mask,
        label_ids=label_ids,
        label_file=Path(label_file),
        held_by_no_party=alignment.dropped,
        cross_party_counts=cross_party_counts,
    )
    return _assemble(
        name=Path(label_file).stem,
        kind="tabular",
        num_classes=len(label_table.classes),
        train_blocks=train_blocks,
        train_labels=labels[train_index],
        test_blocks=test_blocks,
        test_labels=labels[test_index],
        train_missing=train_missing,
        test_missing=test_missing,
        rng=rng,
        held_train=held_train,
        held_test=held_test,
        feature_names=tuple(p.input_columns for p in preprocessing),
        dropped={
            "alignment": alignment.dropped + unlabelled,
            "alignment_no_party": alignment.dropped,
            "alignment_no_label": unlabelled,
        },
        preprocessing=tuple(preprocessing),
        classes=label_table.classes,
        party_names=tuple(names),
        alignment=report,
    )


def alignment_report(
    tables: Sequence[PartyTable],
    paths: Sequence[Path],
    mask: np.ndarray,
    *,
    label_ids: np.ndarray,
    label_file: Path,
    held_by_no_party: int,
    cross_party_counts: bool,
) -> dict[str, Any]:
    """Ids per party file and in the label file(s), the aligned samples, and the ids dropped
    and why: labelled ids that no party holds (the label file's only), and party ids without a
    label (per party; across parties, distinct and held by one party only, when
    ``cross_party_counts``: a plain join sees every id, PSI does not, so they are None then).
    Each party's columns as its preprocessing encoded them come from :func:`column_report`."""
    parties = {}
    for k, (table, path) in enumerate(zip(tables, paths, strict=True)):
        aligned = int(mask[:, k].sum())
        parties[table.name] = {
            "file": str(path),
            "ids": int(table.ids.size),
            "aligned": aligned,
            "without_label": int(table.ids.size) - aligned,
        }
    without_label: int | None = None
    one_party_without_label: int | None = None
    if cross_party_counts:
        unlabelled = [np.setdiff1d(table.ids, label_ids) for table in tables]
        values, holders = np.unique(np.concatenate(unlabelled), return_counts=True)
        without_label = int(values.size)
        one_party_without_label = int((holders == 1).sum())
    return {
        "label_file": {"file": str(label_file), "ids": int(label_ids.size)},
        "parties": parties,
        "samples": int(mask.shape[0]),
        "held_by_every_party": int(mask.all(axis=1).sum()),
        "dropped": {
            "label_file_only": int(held_by_no_party),
            "without_label": without_label,
            "one_party_only_without_label": one_party_without_label,
            "without_label_per_party": {
                name: entry["without_label"] for name, entry in parties.items()
            },
        },
        "duplicate_ids": "refused",
    }


def column_report(
    names: Sequence[str], preprocessing: Sequence[PartyPreprocessing | None]
) -> dict[str, dict[str, Any]]:
    """Each party's columns as its preprocessing turned them into model inputs (see
    :meth:`PartyPreprocessing.describe`), by party name."""
    return {
        name: fitted.describe()
        for name, fitted in zip(names, preprocessing, strict=True)
        if fitted is not None
    }


def _with_held_out(
    train: LabelTable, test: LabelTable, label_file: Path, test_file: Path
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The label file's and the test file's ids and labels (the test labels mapped to the
    training classes) one after the other, and which of them are held out. Refuses an id in
    both files and a test class the training labels never show."""
    shared = np.intersect1d(train.ids, test.ids)
    if shared.size:
        raise DataError(
            f"{test_file}: held-out ids must not be training ids of {label_file}. Found "
            f"{shared.size} in both, e.g. {', '.join(map(repr, shared[:3].tolist()))}."
        )
    # As text where the two files' labels are of different kinds (`0` read as a number in one,
    # as text beside `NA` in the other): a label's text is its own (party_files._label_values).
    key = (lambda value: value) if _same_kind(train.classes, test.classes) else str
    index = {key(value): position for position, value in enumerate(train.classes)}
    unknown = [value for value in test.classes if key(value) not in index]
    if unknown:
        raise DataError(
            f"{test_file}: held-out labels must be among the training classes "
            f"{list(train.classes)} of {label_file}. Found {unknown}."
        )
    test_labels = np.array([index[key(test.classes[i])] for i in test.labels], dtype=np.int64)
    held_out = np.concatenate([np.zeros(train.ids.size, bool), np.ones(test.ids.size, bool)])
    return (
        np.concatenate([train.ids, test.ids]),
        np.concatenate([train.labels, test_labels]),
        held_out,
    )


def _same_kind(first: Sequence[object], second: Sequence[object]) -> bool:
    """Whether two label files' classes are all text, or all numbers."""
    kinds = {isinstance(value, str) for value in (*first, *second)}
    return len(kinds) <= 1


def warn_small_classes(labels: np.ndarray, test_fraction: float, classes: Sequence[object]) -> None:
    """Warn (:class:`RunWarning`) about every class too small for the stratified split to put
    it in both the training and the test split: it is then trained on but never tested, or
    tested but never learned. More than three such classes are one warning."""
    small = []
    for index, count in enumerate(np.bincount(labels, minlength=len(classes))):
        in_test = round(test_fraction * int(count))
        if count and in_test in (0, count):
            small.append((classes[index], int(count), "training" if in_test == 0 else "test"))
    if len(small) > 3:
        shown = ", ".join(f"{value!r} ({count}, {where})" for value, count, where in small[:5])
        warnings.warn(
            f"{len(small)} of {len(classes)} classes have too few aligned samples to appear in "
            f"both the training and the test split (test fraction {test_fraction:g}), e.g. "
            f"{shown} (samples, the split they are in).",
            RunWarning,
            stacklevel=2,
        )
        return
    for value, count, where in small:
        warnings.warn(
            f"class {value!r} has {count} aligned sample(s): too few to appear in both the "
            f"training and the test split (test fraction {test_fraction:g}); it is in the "
            f"{where} split only.",
            RunWarning,
            stacklevel=2,
        )


def _warn_near_matches(ids: np.ndarray, label_ids: np.ndarray, path: Path, labels: Path) -> None:
    """Warn when ids of the party file ``path`` that found no label read as labelled ids that
    found no party row once spaces, case, leading zeros or a ``.0`` are ignored: the same
    samples written differently, left out of training without a word."""
    near = near_matches(ids, label_ids)
    if near:
        own, other = near[0]
        warnings.warn(
            f"{path}: {len(near)} of its ids without a label read as ids of {labels} that none "
            f"of its rows matched, once spaces, case, leading zeros or '.0' are ignored (e.g. "
            f"{own!r} here, {other!r} there); ids are compared as written, so these samples "
            "were left out: write them alike in both files to align them.",
            RunWarning,
            stacklevel=3,
        )


def labeled_subset(n: int, labeled: int | None, *, rng: np.random.Generator) -> np.ndarray:
    """The sorted training rows whose labels are kept in the semi-supervised setting.

    ``labeled=None`` keeps every row; otherwise ``labeled`` rows drawn uniformly without
    replacement from ``rng``. Methods pass ``np.random.default_rng(seed)`` with the run's seed,
    so every method of a run with the same seed labels the same rows (FALSE-VFL's protocol:
    N labelled training samples, the rest unlabelled).
    """
    if labeled is None:
        return np.arange(n, dtype=np.int64)
    if isinstance(labeled, bool) or not isinstance(labeled, int) or not 1 <= labeled <= n:
        raise ConfigError(
            f"`labeled` must be an integer in [1, {n}] (the training samples). Found {labeled!r}."
        )
    return np.sort(rng.choice(n, size=labeled, replace=False)).astype(np.int64)


def label_party_view(data: VerticalData, owner: int = 0) -> VerticalData:
    """What the label party (holding block ``owner``) keeps of ``data``: the labels, the
    availability masks (which parties hold each sample, as alignment tells it; its own copies,
    which change when a party is lost) and its own block; every other party's block is
    replaced by an empty (N, 0) array."""

    def view(split: VerticalSplit) -> VerticalSplit:
        blocks = tuple(
            block if k == owner else np.empty((block.shape[0], 0), dtype=np.float32)
            for k, block in enumerate(split.blocks)
        )
        return VerticalSplit(blocks=blocks, labels=split.labels, mask=split.mask.copy())

    own = None
    if data.preprocessing is not None:
        own = tuple(p if k == owner else None for k, p in enumerate(data.preprocessing))
    return dataclasses.replace(
        data,
        train=view(data.train),
        tests={name: view(s) for name, s in data.tests.items()},
        preprocessing=own,
    )


SHAPE_ONLY_MECHANISMS = ("mcar", "beta", "dirichlet")
"""Missingness mechanisms that draw from the blocks' shapes only: the label party can draw them
without any party's features (a deployment); MAR and MNAR read every party's values."""


@dataclass(frozen=True)
class RowPlan:
    """Where each party's own table rows go in a run on party files, computed by the label
    party from ids alone (a deployment: :mod:`secure_vfl.deployment`).

    ``rows[split]`` (N_split, K) int64: the row of party k's table holding sample i, -1 where
    it does not hold it or the missingness hides it; ``fit_rows[k]``: the rows party k's
    standardiser fits on (the training rows it holds), in the order the in-process pipeline
    (:func:`vertical_from_party_files`) fits on them, so both give the same blocks.
    ``labels[split]`` and ``dropped`` are as in :class:`VerticalData`; ``ids[split]`` (N_split,)
    the label party's id of each sample.
    """

    rows: dict[str, np.ndarray]
    fit_rows: tuple[np.ndarray, ...]
    labels: dict[str, np.ndarray]
    dropped: dict[str, int]
    classes: tuple[object, ...]
    ids: dict[str, np.ndarray]

    def mask(self, split: str) -> np.ndarray:
        """The availability mask (N_split, K) of ``split``."""
        return self.rows[split] >= 0


def _train_test_indices(
    labels: np.ndarray,
    alignment: Alignment,
    label_table: LabelTable,
    held_out: np.ndarray | None,
    test_fraction: float,
    test_file: Path | None,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """The aligned samples' training and test indices: the held-out ids of ``test_file`` (the
    ``held_out`` flags of the label rows), or else a stratified, seeded ``test_fraction``."""
    if held_out is None:
        warn_small_classes(labels, test_fraction, label_table.classes)
        return stratified_split(labels, test_fraction, rng=rng)
    in_test = held_out[alignment.label_rows]
    train_index, test_index = np.flatnonzero(~in_test), np.flatnonzero(in_test)
    if test_index.size == 0 or train_index.size == 0:
        raise DataError(
            f"{test_file}: held-out and training ids that some party file holds expected; "
            f"found {test_index.size} held-out and {train_index.size} training samples."
        )
    return train_index, test_index


AlignLabelIds = Callable[[np.ndarray], "tuple[Alignment, Sequence[int]]"]
"""The label party's alignment of its ids (label and held-out ids): the :class:`Alignment` and
each party's number of ids (to count those without a label)."""


def plan_rows(
    party_ids: Sequence[np.ndarray],
    widths: Sequence[int],
    label_file: Path,
    *,
    aligner: Aligner,
    train_missing: Mechanism,
    test_missing: Sequence[Mechanism],
    test_fraction: float = 0.2,
    test_file: Path | None = None,
    rng: np.random.Generator,
) -> RowPlan:
    """The rows plan of a run on party files from each party's ids and block width only: the
    same alignment, split and masks as :func:`vertical_from_party_files` draws with the same
    ``rng``, for missingness mechanisms that read only shapes
    (:data:`SHAPE_ONLY_MECHANISMS`; ConfigError for another)."""
    sizes = [int(np.asarray(ids).size) for ids in party_ids]
    return plan_rows_by(
        lambda label_ids: (aligner.align(list(party_ids), label_ids), sizes),
        widths,
        label_file,
        train_missing=train_missing,
        test_missing=test_missing,
        test_fraction=test_fraction,
        test_file=test_file,
        rng=rng,
    )


def plan_rows_by(
    align: AlignLabelIds,
    widths: Sequence[int],
    label_file: Path,
    *,
    train_missing: Mechanism,
    test_missing: Sequence[Mechanism],
    test_fraction: float = 0.2,
    test_file: Path | None = None,
    rng: np.random.Generator,
    names: Sequence[str] | None = None,
    labels_read: LabelTable | None = None,
) -> RowPlan:
    """:func:`plan_rows` where ``align`` aligns the label party's ids without it holding the
    other parties' ids (PSI over the network, :mod:`secure_vfl.deployment`): the plan's rows of
    a party are then what ``align`` put in the alignment's rows (for PSI, sample positions that
    the party maps to its own rows). ``names``: the parties', for messages; ``labels_read``: the
    label file as :func:`read_label_file` read it already (None: it is read here)."""
    _check_test_labels(test_missing)
    for mechanism in (train_missing, *test_missing):
        if mechanism.name not in SHAPE_ONLY_MECHANISMS:
            allowed = ", ".join(SHAPE_ONLY_MECHANISMS)
            raise ConfigError(
                f"a missingness mechanism drawn from shapes only ({allowed}) expected when no "
                f"party sees another's features. Found {mechanism.label}."
            )
    label_table = labels_read if labels_read is not None else read_label_file(Path(label_file))
    label_ids, all_labels, held_out = label_table.ids, label_table.labels, None
    if test_file is not None:
        label_ids, all_labels, held_out = _with_held_out(
            label_table, read_label_file(Path(test_file), held_out=True), label_file, test_file
        )
    alignment, sizes = align(label_ids)
    for k in range(alignment.parties):
        if not alignment.mask[:, k].any():
            party = names[k] if names is not None else f"party {k}"
            raise DataError(
                f"no ids of {party} matched the label file {label_file} (ids are compared as "
                "text: expected the same format on both sides)."
            )
    unlabelled = sum(size - int(alignment.mask[:, k].sum()) for k, size in enumerate(sizes))
    labels = all_labels[alignment.label_rows]
    train_index, test_index = _train_test_indices(
        labels, alignment, label_table, held_out, test_fraction, test_file, rng
    )
    train_rows, test_rows = alignment.rows[train_index], alignment.rows[test_index]
    if not (train_rows >= 0).any(axis=0).all():
        raise DataError("every party must hold a training sample to standardise its block.")
    fit_rows = tuple(train_rows[train_rows[:, k] >= 0, k] for k in range(alignment.parties))
    dropped = {
        "alignment": alignment.dropped + unlabelled,
        "alignment_no_party": alignment.dropped,
        "alignment_no_label": unlabelled,
    }
    rows, split_labels, split_ids = {}, {}, {}
    for name, mechanism, held, split_index in [
        ("train", train_missing, train_rows, train_index),
        *[(m.label, m, test_rows, test_index) for m in test_missing],
    ]:
        shapes = [np.broadcast_to(np.float32(0), (held.shape[0], w)) for w in widths]
        drawn = mechanism.sample(shapes, rng=rng)
        _warn_all_observed(mechanism, drawn, shapes, "training" if name == "train" else "test")
        mask = drawn & (held >= 0)
        keep, dropped[name] = drop_unobserved(mask)
        rows[name] = np.where(mask, held, -1)[keep]
        split_labels[name] = labels[split_index][keep]
        split_ids[name] = alignment.sample_ids[split_index][keep]
    return RowPlan(rows, fit_rows, split_labels, dropped, label_table.classes, split_ids)


def party_blocks(
    table: PartyTable,
    fit_rows: np.ndarray,
    rows: dict[str, np.ndarray],
    *,
    missing_cells: str = DEFAULT_MISSING_POLICY,
    id_column: str = ID_COLUMN,
    where: str,
) -> tuple[dict[str, np.ndarray], PartyPreprocessing]:
    """One party's model input of every split from its own ``table``: its preprocessing
    (encoding, the ``missing_cells`` policy, standardisation) fitted on its ``fit_rows`` (the
    training rows it holds), and sample i of a split is row ``rows[split][i]``, zero where -1
    (its training mean after scaling, before the MAR/MNAR rules look at it; the alignment mask
    removes it). The same function in one process and in a deployed party's own process."""
    fitted = PartyPreprocessing.fit(
        table.frame.iloc[fit_rows], missing_cells=missing_cells, id_column=id_column, where=where
    )
    blocks = {}
    for name, split_rows in rows.items():
        block = np.zeros((split_rows.size, *fitted.block_shape), dtype=np.float32)
        held = split_rows >= 0
        if held.any():
            block[held] = fitted.transform_frame(
                table.frame.iloc[split_rows[held]], where, table.booleans
            )
        blocks[name] = block
    return blocks, fitted
