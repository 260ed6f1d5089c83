"""The pieces of word alignment: the median filter is the median of each 7-frame window, the
dynamic-time-warping path is the cheapest monotonic one, and tokens group into words with their
punctuation."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from engine.decode.alignment import (
    MEDIAN_FILTER_WIDTH,
    _dtw_path,
    _median_filter,
    _merge_punctuation,
    _split_words,
)


def _cheapest_cost(cost: np.ndarray) -> float:
    """Brute force over every path of steps right, down or diagonal."""
    rows, columns = cost.shape
    best = np.full((rows, columns), np.inf)
    for i, j in itertools.product(range(rows), range(columns)):
        before = [
            best[i - 1, j - 1] if i and j else np.inf,
            best[i - 1, j] if i else np.inf,
            best[i, j - 1] if j else np.inf,
        ]
        best[i, j] = cost[i, j] + (0.0 if i == j == 0 else min(before))
    return float(best[-1, -1])


@pytest.mark.parametrize("frames", [2, 4, 5, 7, 30, 1500])
def test_the_median_filter_is_the_median_of_each_reflected_seven_frame_window(frames):
    scores = np.random.default_rng(frames).standard_normal((3, 5, frames)).astype(np.float32)
    half = MEDIAN_FILTER_WIDTH // 2
    if frames <= half:
        expected = scores
    else:
        padded = np.pad(scores, [(0, 0), (0, 0), (half, half)], mode="reflect")
        windows = np.lib.stride_tricks.sliding_window_view(padded, MEDIAN_FILTER_WIDTH, axis=-1)
        expected = np.median(windows, axis=-1)
    np.testing.assert_array_equal(_median_filter(scores), expected)


@pytest.mark.parametrize("shape", [(1, 1), (3, 8), (7, 5), (6, 30)])
def test_the_dtw_path_is_monotonic_covers_both_ends_and_is_the_cheapest(shape):
    cost = np.random.default_rng(sum(shape)).standard_normal(shape)
    rows, columns = _dtw_path(cost)
    assert (rows[0], columns[0]) == (0, 0) and (rows[-1], columns[-1]) == (shape[0] - 1, shape[1] - 1)
    steps = set(zip(np.diff(rows), np.diff(columns)))
    assert steps <= {(0, 1), (1, 0), (1, 1)}
    assert cost[rows, columns].sum() == pytest.approx(_cheapest_cost(cost))


def _first_choice_path(cost: np.ndarray) -> tuple[list[int], list[int]]:
    """The DTW path cell by cell: each cell takes the first cheapest of (both, token, frame) before
    it, a NaN counting as cheapest."""
    rows, columns = cost.shape
    total = np.full((rows + 1, columns + 1), np.inf)
    total[0, 0] = 0.0
    step = {}
    for i, j in itertools.product(range(1, rows + 1), range(1, columns + 1)):
        choices = [total[i - 1, j - 1], total[i - 1, j], total[i, j - 1]]
        nans = [k for k, value in enumerate(choices) if np.isnan(value)]
        best = nans[0] if nans else choices.index(min(choices))
        total[i, j] = cost[i - 1, j - 1] + choices[best]
        step[i, j] = best
    path = []
    i, j = rows, columns
    while i > 0 and j > 0:
        path.append((i - 1, j - 1))
        i, j = {0: (i - 1, j - 1), 1: (i - 1, j), 2: (i, j - 1)}[step[i, j]]
    path.reverse()
    return [row for row, _ in path], [column for _, column in path]


@pytest.mark.parametrize("shape", [(1, 1), (1, 6), (6, 1), (4, 9), (9, 4), (12, 40)])
@pytest.mark.parametrize("kind", ["ties", "zeros", "nan"])
def test_the_dtw_path_breaks_ties_by_the_first_choice_and_follows_nan(shape, kind):
    rng = np.random.default_rng(sum(shape))
    cost = rng.integers(-2, 3, shape).astype(np.float64)  # few values: many equal totals
    if kind == "zeros":
        cost[:] = 0.0
    elif kind == "nan":
        cost[rng.random(shape) < 0.2] = np.nan
    rows, columns = _dtw_path(cost)
    expected_rows, expected_columns = _first_choice_path(cost)
    assert rows.tolist() == expected_rows and columns.tolist() == expected_columns


def test_tokens_group_into_words_that_carry_their_punctuation(tiny_en):
    tokenizer = tiny_en.tokenizer
    tokens = tokenizer.encode(' And so, my fellow "Americans": ask!')
    words = _merge_punctuation(_split_words(tokenizer, tokens, "en"))
    assert [word for word, _ in words] == [" And", " so,", " my", " fellow", ' "Americans":', " ask!"]
    assert sum(count for _, count in words) == len(tokens)


def test_languages_without_spaces_split_into_characters_even_across_tokens(tiny_en):
    tokenizer = tiny_en.tokenizer
    tokens = tokenizer.encode("日本語")  # byte-level tokens: a character may take several
    words = _split_words(tokenizer, tokens, "ja")
    assert [word for word, _ in words] == ["日", "本", "語"]
    assert sum(count for _, count in words) == len(tokens)
