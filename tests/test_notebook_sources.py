"""The notebooks' reviewable sources (notebooks/src/*.py, percent format) and the .ipynb files agree,
and either can be rebuilt from the other without loss."""

import sys
from pathlib import Path

import nbformat as nbf
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import notebook_sources as ns  # noqa: E402


def test_committed_notebooks_equal_their_sources():
    assert ns.mismatches() == []


@pytest.mark.parametrize("path", sorted(ns.NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.stem)
def test_round_trip_is_lossless(path):
    nb = nbf.read(path, as_version=4)
    again = ns.from_percent(ns.to_percent(nb, path.name), path.name)
    assert [(c.cell_type, c.source) for c in again.cells] == [(c.cell_type, c.source) for c in nb.cells]


def test_cells_edited_in_jupyter_come_back_exactly():
    cells = [nbf.v4.new_markdown_cell("# Title\n\nA paragraph\n\n* a list"),
             nbf.v4.new_code_cell("x = 1  # %% inside a line is fine\n\n\ny = 2"),
             nbf.v4.new_code_cell(""), nbf.v4.new_markdown_cell("#### heading\n```python\n# a comment\n```")]
    nb = nbf.v4.new_notebook(cells=cells)
    again = ns.from_percent(ns.to_percent(nb))
    assert [(c.cell_type, c.source) for c in again.cells] == [(c.cell_type, c.source) for c in cells]


def test_what_cannot_round_trip_is_refused_by_name():
    nb = nbf.v4.new_notebook(cells=[nbf.v4.new_code_cell("x = 1"), nbf.v4.new_code_cell("\ny = 2")])
    with pytest.raises(ValueError, match="cell 1 begins or ends with an empty line"):
        ns.to_percent(nb, "demo.ipynb")
    nb = nbf.v4.new_notebook(cells=[nbf.v4.new_code_cell("a = 1\n# %%\nb = 2")])
    with pytest.raises(ValueError, match="cell 0 has a line that reads as a cell marker"):
        ns.to_percent(nb, "demo.ipynb")
    with pytest.raises(ValueError, match="uncommented line"):
        ns.from_percent("# %% [markdown]\n# fine\nnot commented\n")
