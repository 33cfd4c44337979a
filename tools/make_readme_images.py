"""Render the README's pictures (docs/images/*.png): figures -> standalone HTML -> headless Chromium screenshot.

python tools/make_readme_images.py   (needs Debian's chromium and the playwright package)
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from mlmkit.distributed import run_ranks
from mlmkit.estimate import estimate_memory
from mlmkit.model import GPTConfig
from mlmkit.trace.export import merge_traces
from mlmkit.train import TrainConfig
from mlmkit.train.trainer import traced_step
from mlmkit.viz import memory_figure, save_html, timeline_comparison

OUT = Path(__file__).resolve().parents[1] / "docs" / "images"
CFG = TrainConfig(model=GPTConfig(vocab_size=256, seq_len=64, hidden=64, heads=4, layers=4), tp=2, pp=2,
                  micro_batch_size=4, global_batch_size=32)


def shoot(fig, name: str, width: int = 1100, height: int = 600) -> None:
    from playwright.sync_api import sync_playwright

    fig.update_layout(width=width, height=height)
    with tempfile.TemporaryDirectory() as d:
        html = save_html(fig, str(Path(d) / f"{name}.html"))
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": width + 20, "height": height + 20})
            page.goto(f"file://{html}")
            page.wait_for_selector(".js-plotly-plot")
            page.locator(".js-plotly-plot").screenshot(path=str(OUT / f"{name}.png"))
            browser.close()
    print("wrote", OUT / f"{name}.png")


if __name__ == "__main__":
    from mlmkit.pipeline import Costs, make_schedule, simulate

    OUT.mkdir(parents=True, exist_ok=True)
    traces = merge_traces(run_ranks(traced_step, world_size=4, args=(CFG.to_dict(),), timeout_s=600))
    ev = traces["events"]
    stats = ev.assign(d=ev.end - ev.start).groupby(["rank", "action"]).d.mean().unstack()
    per_stage = stats.groupby(stats.index // 2).mean()                 # ranks 0,1 = stage 0; 2,3 = stage 1
    sim = simulate(make_schedule("1f1b", stages=2, microbatches=CFG.microbatches),
                   Costs(forward=list(per_stage["F"]), backward=list(per_stage["B"])))
    stage0 = ev[ev["rank"].isin([0, 2])].assign(rank=lambda d: d["rank"] // 2)
    shoot(timeline_comparison(sim.timeline, stage0, title="1F1B on tp=2 x pp=2: simulated (calibrated) vs measured"),
          "timeline", height=520)
    est = estimate_memory(CFG.model, CFG.topology, micro_batch_size=CFG.micro_batch_size, microbatches=CFG.microbatches,
                          precision=CFG.precision)
    shoot(memory_figure(traces["memory"], estimate=est), "memory", height=420)
