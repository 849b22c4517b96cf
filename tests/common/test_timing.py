"""The one timing rule (common/timing.py TIMING_RULE, common.results.timing_summary): the first
epoch of every process is untimed, also after --resume; sec_per_epoch = timed seconds / timed
epochs; images_per_sec = timed images / timed seconds; medians and ranges as extra fields.
A trainer's record after a resume: tests/trainers/test_resume.py."""

from __future__ import annotations

import pytest

from common.results import timing_summary


def rows(secs, timed, images=100):
    return [
        {"epoch": i + 1, "sec": s, "images": images, "timed": t}
        for i, (s, t) in enumerate(zip(secs, timed))
    ]


def test_summary_follows_the_rule() -> None:
    s = timing_summary(rows([9.0, 1.0, 2.0, 6.0], [False, True, True, True]))
    assert s["first_epoch_sec"] == 9.0 and s["timed_epochs"] == 3
    assert s["sec_per_epoch"] == pytest.approx(3.0)  # (1 + 2 + 6) / 3, not the median 2
    assert s["sec_per_epoch_median"] == 2.0
    assert (s["sec_per_epoch_min"], s["sec_per_epoch_max"]) == (1.0, 6.0)
    assert s["images_per_sec"] == pytest.approx(300 / 9)  # timed images / timed seconds
    assert (s["images_per_sec_min"], s["images_per_sec_max"]) == (100 / 6, 100.0)


def test_a_resumed_process_first_epoch_is_untimed() -> None:
    # epochs 1-2 in one process, 3-4 in the resumed one: epochs 1 and 3 hold the warm-up
    s = timing_summary(rows([9.0, 1.0, 8.0, 3.0], [False, True, False, True]))
    assert s["timed_epochs"] == 2 and s["sec_per_epoch"] == pytest.approx(2.0)


def test_one_epoch_falls_back_and_says_untimed() -> None:
    s = timing_summary(rows([4.0], [False]))
    assert s["timed_epochs"] == 0 and s["sec_per_epoch"] == 4.0
