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
    done = subprocess.run([sys.executable, str(EXAMPLE)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "visible pages [3, 3, 3]" in done.stdout
    assert "blocks [0, 1, 2, -1]" in done.stdout


def test_readme_shows_the_examples_as_they_are():
    """Each README block marked `<!-- example: PATH -->` is that file, verbatim."""
    root = EXAMPLE.parents[1]
    readme = root / "README.md"
    if not readme.exists():  # an installed package tested outside a checkout
        return
    text = readme.read_text()
    marker = "<!-- example: "
    shown = 0
    for part in text.split(marker)[1:]:
        path, rest = part.split(" -->", 1)
        block = rest.split("```", 2)[1]  # the fenced block after the marker
        code = block.split("\n", 1)[1]  # drop the language tag line
        assert code == (root / path).read_text(), f"README block of {path} differs from the file"
        shown += 1
    assert shown == 2
