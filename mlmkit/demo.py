"""`make demo`: the main job. Executes notebooks/00_quickstart.ipynb headlessly on CPU ranks, writes an
HTML report with its figures, and prints where it is and a summary (loss, bubble share, memory)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_quickstart(*, notebook: Path, out_dir: Path, timeout_s: int = 900) -> tuple[Path, dict]:
    """Execute ``notebook`` with the working directory ``out_dir.parent``; return (report, summary)."""
    import nbformat
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient
    nb = nbformat.read(notebook, as_version=4)
    workdir = out_dir.parent
    # Local sockets, not TCP, in a fresh private folder: ipc endpoints are files, and another kernel's
    # (or a killed one's) files in the working folder would collide with ours.
    sockets = tempfile.mkdtemp(prefix="mlmkit-kernel-")
    km = KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(sockets, "kernel-ipc"))
    client = NotebookClient(nb, km=km, timeout=timeout_s, kernel_name="python3",
                            resources={"metadata": {"path": str(workdir)}})
    try:
        client.execute()
    finally:
        if km.has_kernel:  # we own the kernel manager, so we stop the kernel
            km.shutdown_kernel(now=False)
        shutil.rmtree(sockets, ignore_errors=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    html = static_report(nb, title="mlmkit quickstart: tp=2 x pp=2 on 4 CPU ranks")
    report = out_dir / "quickstart.html"
    report.write_text(html, encoding="utf-8")
    nbformat.write(nb, out_dir / "quickstart.ipynb")
    written = workdir / "reports" / "quickstart_summary.json"      # where the notebook writes it
    summary = json.loads(written.read_text())
    if written.resolve() != (out_dir / "quickstart_summary.json").resolve():
        (out_dir / "quickstart_summary.json").write_text(written.read_text())
    return report, summary


def static_report(nb, *, title: str) -> str:
    """``nb`` (executed) as a standalone HTML page that loads nothing from the network: widgets show
    their static fallback (a figure, a text) instead of an empty box, no script comes from a CDN
    (plotly.js is embedded by the figures themselves), and the page has ``title``."""
    import copy
    import re

    from nbconvert import HTMLExporter

    nb = copy.deepcopy(nb)
    nb.metadata["title"] = title
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data")
            if data and "application/vnd.jupyter.widget-view+json" in data and len(data) > 1:
                del data["application/vnd.jupyter.widget-view+json"]    # the fallback is shown instead
    nb.metadata.pop("widgets", None)
    html, _ = HTMLExporter().from_notebook_node(nb)
    # No script from the network (require.js, MathJax, the widget renderer): the page works offline.
    html = re.sub(r"<script[^>]*\bsrc=[\"']https?://[^>]*>\s*</script>", "", html)
    html = re.sub(r"<script type=\"text/x-mathjax-config\">.*?</script>", "", html, flags=re.S)
    return html


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--notebook", default=str(ROOT / "notebooks" / "00_quickstart.ipynb"))
    parser.add_argument("--out", default=str(Path.cwd() / "reports"), help="folder for the report (default ./reports)")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    print(f"mlmkit demo: running {args.notebook} on 4 CPU ranks (tp=2 x pp=2) ...", flush=True)
    report, summary = run_quickstart(notebook=Path(args.notebook), out_dir=Path(args.out).resolve())
    print(f"\nreport: {report}")
    print(f"final loss:   {summary['final_loss']:.4f}")
    print(f"bubble share: {summary['bubble_share']:.1%} of the last step (measured)")
    print("peak memory per rank:")
    for rank, nbytes in sorted(summary["peak_memory_bytes_per_rank"].items(), key=lambda kv: int(kv[0])):
        print(f"  rank {rank}: {int(nbytes) / 2**20:8.3f} MiB")
    print(f"(took {time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
