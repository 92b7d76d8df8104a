"""A pytest plugin (loaded first, see pyproject.toml): every test session gets its own Airflow
home, MLflow store and job directories, so tests never touch `.llmops/` or each other's runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SESSION_DIR = Path(tempfile.mkdtemp(prefix="llmops-tests-"))


def pytest_configure(config):
    # Set before anything imports airflow or mlflow: both read these once.
    env = {
        "LLMOPS_HOME": str(SESSION_DIR / "home"),
        "AIRFLOW_HOME": str(SESSION_DIR / "airflow"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{SESSION_DIR / 'mlflow.db'}",
        "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
        "RAY_AUTH_MODE": "disabled",
        "MPLBACKEND": "Agg",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "plugins")]),
    }
    os.environ.update(env)
    os.environ.pop("LLMOPS_STORAGE_ROOT", None)


def pytest_unconfigure(config):
    # The session's Airflow DB, MLflow store, job dirs and models (~25 MB a run) would otherwise
    # pile up in the temp dir run after run. LLMOPS_KEEP_TEST_STATE=1 keeps them to look at.
    if os.environ.get("LLMOPS_KEEP_TEST_STATE") != "1":
        shutil.rmtree(SESSION_DIR, ignore_errors=True)


@pytest.fixture(scope="session")
def airflow_db() -> Path:
    """A migrated SQLite Airflow metadata DB for this session (about 6 s, once)."""
    home = Path(os.environ["AIRFLOW_HOME"])
    if not (home / "airflow.db").exists():
        home.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], check=True,
                       capture_output=True, env=os.environ)
        # The accelerator pool sweep trials and ladder rungs run in
        # (plugins/llmops/airflow/sweep_pool.py).
        subprocess.run([sys.executable, "-m", "llmops.airflow.sweep_pool"], check=True,
                       capture_output=True, env=os.environ)
    return home


def airflow_cli(*args: str, timeout: int = 600, dags_folder: Path | None = None
                ) -> subprocess.CompletedProcess:
    """Run the `airflow` CLI of this venv with the session's environment."""
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    if dags_folder is not None:
        env["AIRFLOW__CORE__DAGS_FOLDER"] = str(dags_folder)
    return subprocess.run([os.path.join(bin_dir, "airflow"), *args], capture_output=True,
                          text=True, env=env, timeout=timeout)


# AWS emulation (moto server) and a local Ray cluster, for the remote backends' tests.
from tests.aws_fixtures import moto_server, ray_cluster  # noqa: E402,F401
# The session's one tiny lifecycle run, shared by the modules that check or build on it.
from tests.lifecycle_run import tiny_lifecycle_run  # noqa: E402,F401
