"""`make screenshots`: the run page's pictures in docs/images/, taken from real runs in Chromium.

Starts `make up` on free ports in a fresh LLMOPS_HOME (its own Airflow and MLflow store), runs
llm_lifecycle on the tiny recipe as a researcher would, and photographs the page of each run:

    run-page-finished.png   a run that computed every stage (the top of its page)
    run-page-gate.png       its promotion gate: the decision, the thresholds and where they come from
    run-page-refused.png    a misspelled Param (`pretrain_step`), refused by start_run
    run-page-cached.png     the same conf again: every stage reused, from where, the time saved
    run-page-running.png    a longer pretraining while it trains (the Now card, the growing bar)
    run-page-paused.png     that pretraining paused from the pause page, and how to resume it

About 8 minutes on 2 cores. The pictures are 1100 pixels wide, cut to the part they show, and
reduced to a 256-colour palette when Pillow is installed (it is, with matplotlib): ~40-90 KB each.

    make screenshots                    # into docs/images/
    .venv/bin/python scripts/screenshots.py --out /tmp/shots --keep   # elsewhere; keep the home
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.ui_driver import DAG_ID, MakeUp, chromium, log_in  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONF = {"recipe": "tiny", "sweep_trials": 1}
PAUSE_CONF = {**CONF, "pretrain_steps": 4000}   # long enough to watch, then to pause
WIDTH = 1100


def summary(airflow: MakeUp, run_id: str) -> dict[str, Any] | None:
    """The run page's figures as JSON (None until MLflow has the run)."""
    try:
        return airflow.request("GET", f"/llmops/runs/{DAG_ID}/{run_id}/summary.json")
    except Exception:  # noqa: BLE001 - 404 until start_run has opened the run
        return None


def training_now(airflow: MakeUp, run_id: str, task: str = "pretrain", min_step: int = 1) -> dict | None:
    """The Now figures of `task` once it has logged `min_step`, else None."""
    found = summary(airflow, run_id) or {}
    return next((r for r in found.get("live") or [] if r["task_id"] == task
                 and (r.get("step") or 0) >= min_step), None)


def pause(airflow: MakeUp, run_id: str) -> dict:
    """What the pause page's button does (llmops.airflow.pause_api): the job checkpoints and
    stops."""
    return airflow.request("POST", f"/llmops-pause/runs/{DAG_ID}/{run_id}", {})


class Camera:
    def __init__(self, browser: Any, airflow: MakeUp, out: Path):
        self.airflow, self.out = airflow, out
        self.context = browser.new_context(viewport={"width": WIDTH, "height": 820})
        self.page = self.context.new_page()
        self.page.set_default_timeout(60_000)
        log_in(self.page, airflow)

    def open(self, run_id: str) -> Any:
        self.page.goto(f"{self.airflow.base}/llmops/runs/{DAG_ID}/{run_id}")
        self.page.locator("#loading").wait_for(state="hidden")
        return self.page

    def shot(self, name: str, selector: str | None = None, height: int | None = None) -> Path:
        """The viewport's top (`height` pixels), or one element (`selector`) of the page."""
        path = self.out / f"{name}.png"
        if selector:
            self.page.locator(selector).first.screenshot(path=str(path))
        else:
            self.page.screenshot(path=str(path), clip={"x": 0, "y": 0, "width": WIDTH,
                                                       "height": height or 820})
        _shrink(path)
        print(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}  "
              f"{path.stat().st_size:,d} bytes", flush=True)
        return path


def _shrink(path: Path) -> None:
    """A 256-colour palette: these pages are flat colours and text, and lose nothing visible."""
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)


def take(out: Path, workdir: Path) -> None:
    # The step cache keys on the code version: pinned, the cached run reuses the first run's
    # stages even in a checkout with uncommitted edits.
    airflow = MakeUp(workdir, {"LLMOPS_GIT_COMMIT": "screenshots",
                               # its own store, not the one `make` exports for the checkout
                               "MLFLOW_TRACKING_URI": f"sqlite:///{workdir / 'home' / 'mlflow.db'}"}).start()
    try:
        with chromium() as browser:
            camera = Camera(browser, airflow, out)
            first = airflow.trigger_cli(CONF)
            _finish(airflow, first, "success")
            camera.open(first)
            camera.shot("run-page-finished", height=900)
            camera.shot("run-page-gate", "#gate")

            refused = airflow.trigger_cli({**CONF, "pretrain_step": 50})
            _finish(airflow, refused, "failed")
            camera.open(refused)
            camera.shot("run-page-refused", height=300)

            cached = airflow.trigger_cli(CONF)
            _finish(airflow, cached, "success")
            camera.open(cached)
            camera.shot("run-page-cached", "#stages")

            long = airflow.trigger_cli(PAUSE_CONF)
            airflow.wait_for("pretraining's first steps", lambda: training_now(airflow, long, min_step=10), 600)
            camera.open(long)
            camera.shot("run-page-running", height=760)
            pause(airflow, long)
            _finish(airflow, long, "success")
            camera.open(long)
            camera.shot("run-page-paused", height=520)
    finally:
        airflow.stop()


def _finish(airflow: MakeUp, run_id: str, expected: str) -> None:
    state = airflow.wait_for_run(run_id)
    if state != expected:
        raise RuntimeError(f"run {run_id} ended {state}, not {expected}: "
                           f"{json.dumps(airflow.task_states(run_id))}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "images"))
    parser.add_argument("--keep", action="store_true", help="keep the deployment's LLMOPS_HOME")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="llmops-screenshots-"))
    started = time.time()
    try:
        take(out, workdir)
    finally:
        if args.keep:
            print(f"The deployment's home: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"Screenshots in {out} ({(time.time() - started) / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
