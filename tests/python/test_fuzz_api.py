"""A bounded run of tests/python/fuzz_api.py (hostile and re-laid-out calls into the Python API on
numpy arrays), in a subprocess so that a crash fails this test with the seed that reproduces it.
MSAIDX_FUZZ_SECONDS sets its length (default 20 s; the script runs for any length by hand)."""

import os
import subprocess
import sys


def test_python_api_fuzz():
    seconds = os.environ.get("MSAIDX_FUZZ_SECONDS", "20")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz_api.py")
    args = [sys.executable, "-W", "ignore::RuntimeWarning", script, "--seconds", seconds]
    seed = os.environ.get("MSAIDX_TEST_SEED")
    if seed:
        args += ["--seed", seed]
    done = subprocess.run(args, capture_output=True, text=True, timeout=float(seconds) + 120)
    report = f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    assert done.returncode == 0, f"exit status {done.returncode}:\n{report}"
    assert " 0 findings" in done.stdout, report
