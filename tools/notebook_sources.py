"""Notebooks as reviewable text: ``notebooks/src/<name>.py`` in the percent format (jupytext's
convention, no jupytext needed) paired with ``notebooks/<name>.ipynb``.

    python tools/notebook_sources.py build      # src/*.py -> *.ipynb (after editing the sources)
    python tools/notebook_sources.py export     # *.ipynb -> src/*.py (after editing in Jupyter)
    python tools/notebook_sources.py check      # both agree (CI: tests/test_notebook_sources.py)

A code cell starts with a line ``# %%``, a markdown cell with ``# %% [markdown]`` and each of its
lines commented (``# text``; ``#`` for an empty line). Cells are separated by one empty line. The
two directions are exact inverses for every cell whose source has no leading or trailing empty
line (the converter refuses the others, naming the cell), so either side can be edited and the
other rebuilt without loss. The .ipynb files are committed without outputs and run by nbval.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat as nbf

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
SOURCES = NOTEBOOKS / "src"
KERNEL = {"kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"},
          "language_info": {"name": "python"}}
CODE, MARKDOWN = "# %%", "# %% [markdown]"


def _check_cell(name: str, i: int, kind: str, source: str) -> None:
    if source != source.strip("\n"):
        raise ValueError(f"{name}: cell {i} begins or ends with an empty line; remove it (the percent format "
                         f"separates cells with one)")
    markers = (CODE, MARKDOWN) if kind == "code" else ("%%", "%% [markdown]")
    if any(line in markers for line in source.split("\n")):
        raise ValueError(f"{name}: cell {i} has a line that reads as a cell marker ('# %%')")


def to_percent(nb, name: str = "notebook") -> str:
    """The percent-format text of ``nb`` (cell sources only)."""
    parts = []
    for i, cell in enumerate(nb.cells):
        src = cell.source
        _check_cell(name, i, cell.cell_type, src)
        if cell.cell_type == "markdown":
            body = "\n".join(f"# {line}" if line else "#" for line in src.split("\n"))
            parts.append(f"{MARKDOWN}\n{body}")
        elif cell.cell_type == "code":
            parts.append(f"{CODE}\n{src}" if src else CODE)
        else:
            raise ValueError(f"{name}: cell {i} is a {cell.cell_type} cell; only code and markdown are kept")
    return "\n\n".join(parts) + "\n"


def from_percent(text: str, name: str = "notebook"):
    """A notebook (no outputs, stable cell ids) from percent-format ``text``."""
    cells, kind, lines = [], None, []

    def close():
        if kind is None:
            return
        body = lines[:]
        while body and body[-1] == "":           # the separating empty line(s)
            body.pop()
        if kind == "markdown":
            out = []
            for line in body:
                if line == "#":
                    out.append("")
                elif line.startswith("# "):
                    out.append(line[2:])
                else:
                    raise ValueError(f"{name}: markdown cell {len(cells)} has an uncommented line: {line!r}")
            cells.append(nbf.v4.new_markdown_cell("\n".join(out)))
        else:
            cells.append(nbf.v4.new_code_cell("\n".join(body)))

    for line in text.split("\n"):
        if line in (CODE, MARKDOWN):
            close()
            kind, lines = ("markdown" if line == MARKDOWN else "code"), []
        elif kind is None:
            if line.strip():
                raise ValueError(f"{name}: text before the first '# %%' line: {line!r}")
        else:
            lines.append(line)
    close()
    for i, cell in enumerate(cells):
        cell["id"] = f"cell-{i:03d}"            # stable ids: rebuilding changes only what changed
    return nbf.v4.new_notebook(cells=cells, metadata=KERNEL)


def build(names=None) -> list[Path]:
    out = []
    for src in sorted(SOURCES.glob("*.py")):
        if names and src.stem not in names:
            continue
        nb = from_percent(src.read_text(encoding="utf-8"), src.name)
        path = NOTEBOOKS / f"{src.stem}.ipynb"
        nbf.write(nb, path)
        out.append(path)
    return out


def export(names=None) -> list[Path]:
    SOURCES.mkdir(exist_ok=True)
    out = []
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        if names and path.stem not in names:
            continue
        nb = nbf.read(path, as_version=4)
        src = SOURCES / f"{path.stem}.py"
        src.write_text(to_percent(nb, path.name), encoding="utf-8")
        out.append(src)
    return out


def mismatches() -> list[str]:
    """Notebooks whose cells differ from their sources (or that lack one)."""
    bad = []
    ipynbs = {p.stem for p in NOTEBOOKS.glob("*.ipynb")}
    srcs = {p.stem for p in SOURCES.glob("*.py")}
    bad += [f"{n}.ipynb has no src/{n}.py" for n in sorted(ipynbs - srcs)]
    bad += [f"src/{n}.py has no {n}.ipynb" for n in sorted(srcs - ipynbs)]
    for n in sorted(ipynbs & srcs):
        built = from_percent((SOURCES / f"{n}.py").read_text(encoding="utf-8"), n)
        nb = nbf.read(NOTEBOOKS / f"{n}.ipynb", as_version=4)
        if [(c.cell_type, c.source) for c in built.cells] != [(c.cell_type, c.source) for c in nb.cells]:
            bad.append(f"{n}: the notebook and src/{n}.py differ (run build or export)")
    return bad


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cmd, names = (argv[0] if argv else "build"), set(argv[1:])
    if cmd == "build":
        for p in build(names):
            print("wrote", p)
    elif cmd == "export":
        for p in export(names):
            print("wrote", p)
    elif cmd == "check":
        bad = mismatches()
        for b in bad:
            print(b)
        return 1 if bad else 0
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
