"""JupyterLab in headless Chromium: open the quickstart notebook, run it up to the cell that stops the
cluster, then use it as a student would: the schedule explorer reacts to a changed schedule and a
moved slider, an invalid setting shows its message below the controls, the stepping widget's
"whole step" button advances the real 4-rank session; then run the rest. Keeps a screenshot
(artifacts/quickstart_lab.png)."""

import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = ROOT / "artifacts"

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed "
                                 "(apt-get install chromium); .ci/run installs it")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def lab(tmp_path):
    shutil.copy(ROOT / "notebooks" / "00_quickstart.ipynb", tmp_path / "00_quickstart.ipynb")
    port, token = _free_port(), secrets.token_hex(16)
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           f"--ServerApp.token={token}", f"--ServerApp.root_dir={tmp_path}", "--LabApp.expose_app_in_browser=True",
           "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")  # CI runs as root
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("JupyterLab did not start:\n" + (tmp_path / "lab.log").read_text()[-3000:])
            time.sleep(0.5)
    yield url, token, tmp_path
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def _give_up(signum, frame):
    raise TimeoutError("the browser test ran past its 10-minute bound")


def test_quickstart_renders_in_jupyterlab(lab):
    import signal

    from playwright.sync_api import sync_playwright

    url, token, workdir = lab
    ARTIFACTS.mkdir(exist_ok=True)
    previous = signal.signal(signal.SIGALRM, _give_up)
    signal.alarm(600)  # every step below has its own timeout; this bounds the whole test anyway
    try:
        _drive_lab(sync_playwright, url, token, workdir)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# The cells above `stop` not yet run, none of them running or queued: -1 while any prompt above
# shows [*], else the index of the first code cell without an execution count (-2: all ran).
_STALLED = """(stop) => { const nb = window.jupyterapp.shell.currentWidget.content;
    const text = nb.widgets.slice(0, stop).map(c => { const p = c.node.querySelector('.jp-InputArea-prompt');
                                                      return p ? p.textContent : ''; });
    if (text.some(t => t.includes('*'))) return -1;
    const first = nb.widgets.findIndex((c, i) => i < stop && c.model.type === 'code' && !/\\[\\d+\\]/.test(text[i]));
    return first < 0 ? -2 : first; }"""
_RESUME = """([first, stop]) => { const nb = window.jupyterapp.shell.currentWidget.content;
    for (let i = first; i < stop; i++) {
        if (nb.widgets[i].model.type !== 'code') continue;
        nb.deselectAll(); nb.activeCellIndex = i; window.jupyterapp.commands.execute('notebook:run-cell'); }
    return true; }"""


def _wait_for_a_plot(page, stop: int, timeout_s: float = 150.0) -> None:
    """Wait for the first plotly figure. Seen once (jupyter_server answered the kernel's websocket
    with a 500 and the client reconnected): the execute requests of run-all-above were lost after
    the first cell, and nothing ran or was queued. When the cells above ``stop`` stay idle with
    some not run, for two checks in a row, the rest are queued again, cell by cell."""
    deadline, idle = time.monotonic() + timeout_s, 0
    while True:
        try:
            page.wait_for_selector(".jp-OutputArea-output .js-plotly-plot", timeout=10_000)
            return
        except Exception:  # noqa: BLE001 - not yet; a timeout below says so
            if time.monotonic() > deadline:
                raise
        first = page.evaluate(_STALLED, stop)
        idle = idle + 1 if first >= 0 else 0
        if idle >= 2:
            page.evaluate(_RESUME, [first, stop])
            idle = 0


def _drive_lab(sync_playwright, url, token, workdir):
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            page.goto(f"{url}/lab/tree/00_quickstart.ipynb?token={token}")
            page.wait_for_selector(".jp-Notebook", timeout=60_000)
            page.wait_for_function("window.jupyterapp !== undefined && document.querySelector('.jp-Notebook-cell')",
                                   timeout=60_000)
            # The kernel must be ready, and the notebook the current widget, before running everything.
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=90_000)
            # Run every cell above the one that stops the cluster, so that the widgets stay live.
            run_above = """() => { const nb = window.jupyterapp.shell.currentWidget.content;
                const i = nb.widgets.findIndex(c => c.model.sharedModel.getSource().trim() === 'cluster.shutdown()');
                nb.activeCellIndex = i; window.jupyterapp.commands.execute('notebook:run-all-above'); return i; }"""
            started, shutdown_cell = False, -1
            for _ in range(3):
                # JupyterLab sometimes asks for the kernel while it starts ("Select Kernel", Python 3
                # preselected): a modal dialog over every cell. Accept it, as a user would.
                dialog = page.locator(".jp-Dialog .jp-mod-accept")
                if dialog.count():
                    dialog.first.click()
                    page.wait_for_selector(".jp-Dialog", state="detached", timeout=10_000)
                try:
                    page.locator(".jp-Notebook .jp-Cell").first.click(timeout=10_000)
                except Exception:  # noqa: BLE001 - a dialog that came up meanwhile: accept it, try again
                    page.screenshot(path=str(ARTIFACTS / "quickstart_lab_not_started.png"))
                    continue
                # Do not await the command: its promise settles only when every cell has run.
                shutdown_cell = page.evaluate(run_above)
                try:  # a prompt turns into [*] or [n] once cells run
                    page.wait_for_function("Array.from(document.querySelectorAll('.jp-InputArea-prompt'))"
                                           ".some(e => /\\[(\\*|\\d+)\\]/.test(e.textContent))", timeout=20_000)
                    started = True
                    break
                except Exception:  # noqa: BLE001 - try again
                    page.screenshot(path=str(ARTIFACTS / "quickstart_lab_not_started.png"))
            assert started and shutdown_cell > 0, "run-all-above did not start (see quickstart_lab_not_started.png)"
            _wait_for_a_plot(page, shutdown_cell)
            page.wait_for_selector(".jp-OutputArea-output .widget-dropdown select", timeout=150_000)
            page.wait_for_selector(".jp-OutputArea-output .widget-slider", timeout=60_000)
            page.wait_for_function(
                "Array.from(document.querySelectorAll('.jp-InputArea-prompt')).every("
                "e => !e.textContent.includes('*'))", timeout=200_000)
            _use_the_widgets(page)
            # Now the rest: stop the cluster (and anything after it).
            page.evaluate("""(i) => { const nb = window.jupyterapp.shell.currentWidget.content;
                nb.activeCellIndex = i; window.jupyterapp.commands.execute('notebook:run-all-below'); return true; }""",
                          shutdown_cell)
            page.wait_for_function(
                "(i) => { const p = document.querySelectorAll('.jp-Notebook .jp-Cell')[i]"
                ".querySelector('.jp-InputArea-prompt'); return /\\[\\d+\\]/.test(p.textContent); }",
                arg=shutdown_cell, timeout=120_000)
            page.wait_for_function(
                "Array.from(document.querySelectorAll('.jp-InputArea-prompt')).every("
                "e => !e.textContent.includes('*'))", timeout=120_000)
            errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
            tracebacks = [t for t in errors.all_inner_texts() if "Traceback" in t or "Error" in t.split("\n")[0]]
            assert not tracebacks, tracebacks[:2]
            plots = page.locator(".jp-OutputArea-output .js-plotly-plot").count()
            assert plots >= 5, plots
            explorer = page.locator(".jp-OutputArea-output .widget-dropdown select").first
            explorer.scroll_into_view_if_needed()
            page.screenshot(path=str(ARTIFACTS / "quickstart_lab.png"), full_page=False)
            assert (workdir / "reports" / "quickstart_summary.json").exists()
        except Exception as exc:
            # Say what the notebook was doing: a wait that times out says nothing about why.
            page.screenshot(path=str(ARTIFACTS / "quickstart_lab_failed.png"))
            raise AssertionError(f"{type(exc).__name__}: {str(exc)[:400]}\n{_explain(page, workdir)}") from exc
        finally:
            page.screenshot(path=str(ARTIFACTS / "quickstart_lab_last.png"))
            browser.close()


def _explain(page, workdir) -> str:
    """The notebook's state when the test failed: each cell's prompt with the start of its source,
    error outputs, and the end of JupyterLab's log (screenshot: artifacts/quickstart_lab_failed.png)."""
    try:
        cells = page.evaluate("""() => Array.from(document.querySelectorAll('.jp-Notebook .jp-Cell')).map(c => {
            const p = c.querySelector('.jp-InputArea-prompt'), src = c.querySelector('.jp-InputArea-editor');
            return (p ? p.textContent.trim() : '') + ' ' + (src ? src.textContent.trim().slice(0, 60) : ''); })""")
        errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']").all_inner_texts()
    except Exception as exc:  # noqa: BLE001 - the page itself may be gone
        cells, errors = [f"(page unreadable: {exc})"], []
    done = [c for c in cells if re.match(r"\[\d+\]", c)]
    waiting = [c for c in cells if c.startswith("[*]")]
    log = workdir / "lab.log"
    tail = log.read_text()[-2000:] if log.exists() else ""
    return (f"{len(done)} cells ran, the last: " + (done[-1] if done else "none")
            + "\nrunning, then queued (prompt, source):\n  " + "\n  ".join(waiting[:3])
            + "\nerror outputs:\n  " + "\n  ".join(e[-800:] for e in errors[-3:])
            + "\nJupyterLab log (end):\n" + tail)


def _text(locator) -> str:
    return locator.inner_text(timeout=30_000)


def _use_the_widgets(page) -> None:
    """What a student does with the live widgets; each must visibly react."""
    # The schedule explorer: another schedule in the dropdown changes its summary.
    explorer = page.locator(".jp-OutputArea-output .widget-vbox", has=page.locator(".widget-dropdown select")).first
    explorer.scroll_into_view_if_needed()
    summary = explorer.locator(".widget-html", has_text="step time").first
    before = _text(summary)
    explorer.locator(".widget-dropdown select").first.select_option("interleaved-1f1b")
    page.wait_for_function("(b) => Array.from(document.querySelectorAll('.widget-html'))"
                           ".some(e => e.innerText.includes('interleaved-1f1b') && e.innerText !== b)", arg=before,
                           timeout=30_000)
    # A slider moved with the keyboard: m from 4 to 3 is not a valid interleaved schedule for p = 2,
    # and the message appears (below the controls); back to 4, it goes away.
    slider = explorer.locator(".widget-slider", has_text="microbatches m").first
    handle = slider.locator(".noUi-handle").first
    handle.focus()
    page.keyboard.press("ArrowLeft")
    page.wait_for_function("() => Array.from(document.querySelectorAll('.widget-html'))"
                           ".some(e => e.innerText.includes('Not a valid schedule'))", timeout=30_000)
    assert "microbatch" in _text(explorer.locator(".widget-html", has_text="Not a valid schedule").first)
    handle.focus()
    page.keyboard.press("ArrowRight")
    page.wait_for_function("() => !Array.from(document.querySelectorAll('.widget-html'))"
                           ".some(e => e.innerText.includes('Not a valid schedule'))", timeout=30_000)
    # The stepping widget: "whole step" runs one more step of the real 4-rank session.
    step = page.locator(".jp-OutputArea-output button", has_text="whole step").first
    step.scroll_into_view_if_needed()
    texts = page.evaluate("() => Array.from(document.querySelectorAll('.widget-html')).map(e => e.textContent)")
    found = [m for m in (re.search(r"steps done:\s*(\d+)", t) for t in texts) if m]
    assert found, [t[:80] for t in texts]
    done = int(found[0].group(1))
    step.click()
    page.wait_for_function(f"() => Array.from(document.querySelectorAll('.widget-html'))"
                           f".some(e => e.textContent.includes('steps done: {done + 1}'))", timeout=120_000)
