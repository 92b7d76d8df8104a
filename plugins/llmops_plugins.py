"""The Airflow plugins this project registers.

Airflow imports every `.py` file in the plugins folder as a top-level module named after the file.
The `llmops` library is kept out of that scan by `.airflowignore`: its modules named `ray.py`,
`settings.py`, `sagemaker.py`... would otherwise replace the real packages of those names in
`sys.modules` of every Airflow process, and run twice under two names. The library is imported
normally (the plugins folder is on sys.path) and its plugins are registered here.
"""

from airflow.plugins_manager import AirflowPlugin

from llmops.airflow import pause_api, run_note, run_page
from llmops.airflow import sweep_pool


class SweepPoolPlugin(AirflowPlugin):
    """Creates the sweep pool when a run that needs it starts and the pool is missing."""

    name = "llmops_sweep_pool"
    listeners = [sweep_pool] if sweep_pool.hookimpl is not None else []


class RunPagePlugin(AirflowPlugin):
    """One page per lifecycle run: a tab "LLM run" on every DAG run page (an external view of the
    FastAPI app the API server mounts under /llmops), and the run's note from its promote task."""

    name = "llmops_run_page"
    fastapi_apps = [{"app": run_page.app, "url_prefix": run_page.URL_PREFIX, "name": "llmops run page"}]
    external_views = [{"name": "LLM run", "href": run_page.RUN_PAGE_HREF, "destination": "dag_run",
                       "url_route": "llm-run"}]
    listeners = [run_note] if run_note.hookimpl is not None else []


class PausePlugin(AirflowPlugin):
    """Pause a running pretraining from the UI: the pretrain task's link "Pause pretraining" opens
    a page of this app (mounted under /llmops-pause), whose button writes the job's PAUSE marker."""

    name = "llmops_pause"
    fastapi_apps = [{"app": pause_api.app, "url_prefix": pause_api.URL_PREFIX,
                     "name": "llmops pause pretraining"}]
