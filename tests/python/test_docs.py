"""docs/engines.md's Python example runs as written (on the GPU where there is one, else with
device = "cpu"). Skipped without torch."""

import os
import re

import pytest

torch = pytest.importorskip("torch")

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "engines.md")


def test_engines_example_runs():
    with open(DOC) as doc:
        example = re.search(r"```python\n(.*?)```", doc.read(), re.S).group(1)
    if not torch.cuda.is_available():
        assert 'device = "cuda"' in example
        example = example.replace('device = "cuda"', 'device = "cpu"')
    namespace = {}
    exec(compile(example, DOC, "exec"), namespace)
    picked = namespace["topk"][0, -1]
    assert picked.shape == (16,) and bool((picked[1:] > picked[:-1]).all())
