"""The notebooks execute top to bottom on this machine (CPU: small sizes) without error.

They are built by `notebooks/make_notebooks.py`; this runs the committed .ipynb files
in a fresh kernel of this interpreter, so an API change that breaks them fails here.
"""

import os
import pathlib
import sys

import pytest

# The notebook tools come with the `test` extra; a bare GPU image may lack them.
nbformat = pytest.importorskip("nbformat")
NotebookClient = pytest.importorskip("nbclient").NotebookClient
KernelSpecManager = pytest.importorskip("jupyter_client.kernelspec").KernelSpecManager

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
KERNEL = "python3"


def test_kernel_is_this_interpreter():
  """The python3 kernelspec must start *this* venv's Python (jupyter_client maps a bare
  "python" argv[0] to sys.executable), or the notebooks would test another environment."""
  argv0 = KernelSpecManager().get_kernel_spec(KERNEL).argv[0]
  assert argv0 in ("python", "python3") or os.path.realpath(argv0) == os.path.realpath(sys.executable)


def test_committed_notebooks_match_their_generator():
  """The .ipynb files hold the cells of notebooks/make_notebooks.py (edit them there)."""
  sys.path.insert(0, str(NOTEBOOKS))
  try:
    import make_notebooks
  finally:
    sys.path.remove(str(NOTEBOOKS))
  for name, cells in make_notebooks.NOTEBOOKS.items():
    committed = nbformat.read(NOTEBOOKS / name, as_version=4)
    assert [c.source for c in committed.cells] == [c.source for c in cells], (
        f"{name} is stale: run python notebooks/make_notebooks.py")


@pytest.mark.parametrize("name", ["01_quickstart.ipynb", "02_benchmarks.ipynb"])
def test_notebook_executes(name):
  nb = nbformat.read(NOTEBOOKS / name, as_version=4)
  NotebookClient(nb, timeout=300, kernel_name=KERNEL,
                 resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == "error"]
  assert not errors
  text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
  assert "False" not in text, "a notebook self-check printed False"
