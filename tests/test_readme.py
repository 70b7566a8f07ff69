"""The README's functional-API example runs as written."""

import pathlib
import re

import numpy as np


def test_readme_example_runs():
  text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
  example = re.findall(r"```python\n(.*?)```", text, re.S)[0]
  scope: dict = {}
  exec(compile(example, "README.md", "exec"), scope)
  np.testing.assert_array_equal(np.asarray(scope["out"]), [2 * 576] * 4)
