"""The reliability suite's GPU cases (fault injection, corruption, soak, concurrency, GPU bad input).

Each case runs in a fresh interpreter (an abort or a hang fails the case); the
units run in parallel on first use. Skipped, with the reason, without a GPU.
``GFXGRAPH_RELIABILITY_SCALE=0.01`` makes the soak a smoke run.
"""

from __future__ import annotations

import pytest

from rel_pytest import check, params, reliability_results  # noqa: F401 - the fixture is used by name

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("case_name", params("gpu"))
def test_gpu_case(case_name: str, reliability_results) -> None:  # noqa: F811
    check(reliability_results(case_name))
