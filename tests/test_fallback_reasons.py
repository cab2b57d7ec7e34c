"""Fallback reasons: one closed enum, one value type, and the README's table of them kept in step."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

import gfxgraph
from hipgraph_bridge import stats
from hipgraph_bridge.fallbacks import Fallback, Reason

REPO = Path(__file__).resolve().parents[1]


def _readme_reasons() -> dict[str, str]:
    text = (REPO / "README.md").read_text()
    section = text.split("### Fallback reasons", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z_]+)` \| (eager|padding) \|", section, flags=re.M)
    return dict(rows)


def test_the_readme_table_lists_every_reason_and_no_other():
    table = _readme_reasons()
    assert set(table) == {r.value for r in Reason}


def test_the_readme_says_which_reasons_stop_padding():
    table = _readme_reasons()
    assert {k for k, kind in table.items() if kind == "padding"} == {r.value for r in Reason if r.refuses_padding}


def test_a_fallback_is_counted_under_its_reason_and_logged_once(caplog):
    caplog.set_level(logging.INFO, logger="gfxgraph.fallback")
    fb = Fallback(Reason.OVERSIZE, "batches above the largest bucket 4", logging.INFO)
    for _ in range(3):
        stats.record_fallback(fb)
    assert gfxgraph.stats()["fallback_reasons"] == {"oversize": 3}
    assert caplog.text.count("running eagerly (reason: oversize): batches above the largest bucket 4") == 1
    stats.record_fallback(Fallback(Reason.ROWS_COUPLED, "aten.mean reduces over the batch dimension"))
    assert "not padding (reason: rows_coupled)" in caplog.text


def test_reasons_are_strings_and_only_known_ones_are_accepted():
    assert Reason.VRAM_CAP == "vram_cap" and str(Reason.VRAM_CAP) == "vram_cap"
    assert Fallback("no_gpu").reason is Reason.NO_GPU  # a name is turned into the enum
    with pytest.raises(ValueError, match="'padding_unsafe' is not a valid Reason"):
        Fallback("padding_unsafe")
    with pytest.raises(TypeError, match="expected a Fallback"):
        stats.record_fallback("oversize")  # type: ignore[arg-type]


def test_no_record_in_the_package_names_a_reason_as_a_bare_string():
    src = REPO / "src"
    bare = [f"{p.relative_to(REPO)}:{i}" for p in src.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if re.search(r"record_fallback\(\s*[\"']", line)]
    assert bare == []
