"""Runs a start-up test's child script in a fresh interpreter with its own inductor cache folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def run_child(code: str, mode: str, path: str, cache_dir: str, *, timeout: int) -> dict:
    """``code`` run as ``python -c code mode path`` with ``TORCHINDUCTOR_CACHE_DIR=cache_dir``; the JSON
    object its last line of output prints."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    done = subprocess.run([sys.executable, "-c", code, mode, path], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
