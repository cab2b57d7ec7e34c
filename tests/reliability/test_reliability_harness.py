"""The harness itself: an abort, a segfault, a hang, an exit code and an abort at exit are each
classified as such (a suite that cannot see them would count them as passes)."""

from __future__ import annotations

import pytest

import rel_harness
import rel_registry

EXPECTED = {
    "selftest_pass": "pass",
    "selftest_abort": "abort",
    "selftest_segfault": "abort",
    "selftest_hang": "hang",
    "selftest_exit_code": "crash",
    "selftest_abort_at_exit": "abort",
    "selftest_silent_wrong": "silent_wrong",
    "selftest_assertion": "fail",
    "selftest_group_pass": "pass",
    "selftest_group_abort": "abort",
    "selftest_group_unreached": "crash",
}


@pytest.fixture(scope="module")
def selftest_results():
    mp = pytest.MonkeyPatch()
    mp.setenv(rel_registry.EXTRA_ENV, "rel_selftest_cases")
    try:
        rel_registry.load()
        units = sorted({rel_registry.get(name).unit for name in EXPECTED})
        results = rel_harness.run_units(units, workers=8)
    finally:
        mp.undo()
    return {r["name"]: r for r in results}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_harness_classifies(name, selftest_results):
    r = selftest_results[name]
    assert r["status"] == EXPECTED[name], r


def test_summary_counts_each_column(selftest_results):
    rows = rel_harness.summarize(list(selftest_results.values()))
    assert rows["total"]["cases"] == len(EXPECTED)
    assert (rows["total"]["aborts"], rows["total"]["hangs"], rows["total"]["silent_wrong"]) == (4, 1, 1)
    assert rows["total"]["passed"] == 2 and rows["total"]["failed"] == 3
    assert "| **total** | 11 | 2 | 3 | 4 | 1 | 1 | 0 |" in rel_harness.format_table(rows)
