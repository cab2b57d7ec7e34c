"""The reliability cases that need no GPU (bad input, environment, CLI, enable/disable threads).

They run on CPU-only machines (CI) and on the GPU machine alike, each group in a
fresh interpreter.
"""

from __future__ import annotations

import pytest

from rel_pytest import check, params, reliability_results  # noqa: F401 - the fixture is used by name


@pytest.mark.parametrize("case_name", params("any"))
def test_any_case(case_name: str, reliability_results) -> None:  # noqa: F811
    check(reliability_results(case_name))
