"""Aligner contract (every aligner subclasses it; the PSI one in test_psi.py) and the plain
join."""

from __future__ import annotations

import numpy as np
import pytest

from secure_vfl.errors import DataError
from secure_vfl.federation.alignment import Aligner, Alignment, JoinAligner


class AlignerContract:
    """What every :class:`Aligner` must do; subclasses provide ``make_aligner``."""

    def make_aligner(self) -> Aligner:
        raise NotImplementedError

    def test_rows_and_mask_locate_each_sample(self):
        party_ids = [
            np.array(["c", "a", "b", "x"]),  # holds a, b, c (and an unlabelled x)
            np.array(["d", "b"]),  # holds b, d
            np.array(["a"]),
        ]
        label_ids = np.array(["d", "b", "e", "a", "c"])  # e is held by no party
        alignment = self.make_aligner().align(party_ids, label_ids)
        assert alignment.sample_ids.tolist() == ["a", "b", "c", "d"]
        assert alignment.rows.tolist() == [
            [1, -1, 0],
            [2, 1, -1],
            [0, -1, -1],
            [-1, 0, -1],
        ]
        np.testing.assert_array_equal(alignment.mask, alignment.rows >= 0)
        assert alignment.label_rows.tolist() == [3, 1, 4, 0]
        assert alignment.dropped == 1
        np.testing.assert_allclose(alignment.observed_fraction(), [0.75, 0.5, 0.25])
        for k, ids in enumerate(party_ids):
            held = alignment.mask[:, k]
            np.testing.assert_array_equal(ids[alignment.rows[held, k]], alignment.sample_ids[held])
        np.testing.assert_array_equal(label_ids[alignment.label_rows], alignment.sample_ids)

    def test_integer_ids_sort_numerically(self):
        alignment = self.make_aligner().align([np.array([10, 9, 100])], np.array([100, 9, 10]))
        assert alignment.sample_ids.tolist() == [9, 10, 100]
        assert alignment.rows[:, 0].tolist() == [1, 0, 2]

    def test_no_overlap_gives_empty_alignment(self):
        alignment = self.make_aligner().align([np.array(["a"])], np.array(["b", "c"]))
        assert alignment.sample_ids.size == 0 and alignment.rows.shape == (0, 1)
        assert alignment.dropped == 2

    def test_duplicate_ids_are_refused(self):
        with pytest.raises(DataError, match="party 1 ids must be unique"):
            self.make_aligner().align([np.array(["a"]), np.array(["a", "a"])], np.array(["a"]))
        with pytest.raises(DataError, match="label party ids must be unique"):
            self.make_aligner().align([np.array(["a"])], np.array(["a", "a"]))

    def test_ids_mixing_text_and_numbers_are_refused_naming_one(self):
        """numpy sorts an object array by comparing its values: text beside numbers raised a
        raw TypeError ('<' not supported between 'int' and 'str')."""
        aligner = self.make_aligner()
        with pytest.raises(
            DataError,
            match=r"party 0 ids must be all text or all numbers\. "
            r"Found int 1 among text ids\.",
        ):
            aligner.align([np.array(["a", 1, "b"], dtype=object)], np.array(["a", "b"]))
        with pytest.raises(DataError, match=r"label party ids .* Found str 'a' among number"):
            aligner.align([np.array([1, 2])], np.array([2, "a"], dtype=object))
        with pytest.raises(DataError, match=r"Found bool True among number ids"):
            aligner.align([np.array([1, True], dtype=object)], np.array([1, 2]))
        mixed_numbers = aligner.align(
            [np.array([1, 2.5], dtype=object)], np.array([2.5, 3], dtype=object)
        )
        assert mixed_numbers.sample_ids.tolist() == [2.5]


class TestJoinAligner(AlignerContract):
    def make_aligner(self) -> Aligner:
        return JoinAligner()

    def test_mixed_id_kinds_are_refused(self):
        with pytest.raises(DataError, match=r"same kind as the label ids \(text\). Found number"):
            JoinAligner().align([np.array([1, 2])], np.array(["1", "2"]))

    def test_alignment_validates_rows(self):
        with pytest.raises(DataError, match="`rows` must be int64"):
            Alignment(np.array(["a"]), np.zeros((1, 2), np.int32), np.zeros(1, np.int64))


def test_aligners_are_chosen_by_name_and_unknown_names_are_refused():
    from secure_vfl.errors import ConfigError
    from secure_vfl.federation.alignment import JoinAligner, make_aligner

    assert isinstance(make_aligner("join"), JoinAligner)
    with pytest.raises(ConfigError, match=r"unknown aligner 'magic'.*importing protocols\.psi"):
        make_aligner("magic")
