"""The README's Python example runs as written (examples/quickstart.py)."""
import os
import pathlib
import subprocess
import sys

import msaidx

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "quickstart.py"


def test_quickstart_runs_as_written():
    # The example imports msaidx as a user would: from wherever this test imported it.
    env = dict(os.environ)
    package_root = str(pathlib.Path(msaidx.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, str(EXAMPLE)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "visible pages [3, 3, 3]" in done.stdout
    assert "blocks [0, 1, 2, -1]" in done.stdout
