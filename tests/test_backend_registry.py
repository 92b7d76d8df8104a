"""A backend is one folder plus one registry line: a toy backend written into a folder outside
the repository and registered by its one line in llmops.jobs.backends.BACKENDS is picked up by
everything that reads backends (start_run's settings check, the Variable's settings block, the
task's console links and buttons, the backend Params' choices, get_backend), with no other file
touched. The toy runs its jobs as the local backend does (it subclasses LocalBackend); the rest
of it is its own: settings it requires, where its console is, its links.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from llmops.airflow.operators import links
from llmops.jobs import backends
from llmops.jobs.backends import backend_settings
from llmops.policy import params as knobs
from llmops.stages import lifecycle

FOLDER = {
    "__init__.py": '''
        """A toy backend: its jobs run here, its console is wherever its handle says."""
        from llmops.jobs.backends.base import BackendEntry


        def console(handle):
            return handle.get("toy_console", "")


        def console_links(handle, host):
            return {"Toy job": f"{host}/jobs/{handle['job_name']}"}


        ENTRY = BackendEntry(backend="toy_backend.toy_jobs.ToyBackend",
                             settings="toy_backend.toy_settings.ToySettings",
                             required=("staging_uri", "queue"), aws=False,
                             host=console, links=console_links, buttons=("Toy job",))
        ''',
    "toy_settings.py": '''
        from dataclasses import dataclass

        from llmops.jobs.backends.remote_settings import RemoteSettings


        @dataclass(kw_only=True)
        class ToySettings(RemoteSettings):
            queue: str = ""
        ''',
    "toy_jobs.py": '''
        from llmops.jobs.backends.local.local_backend import LocalBackend


        class ToyBackend(LocalBackend):
            name = "toy"
        ''',
}


def toy_folder(tmp_path, monkeypatch) -> None:
    """The toy's folder, importable as `toy_backend`, outside the repository."""
    folder = tmp_path / "toy_backend"
    folder.mkdir()
    for name, text in FOLDER.items():
        (folder / name).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.fixture()
def toy(tmp_path, monkeypatch):
    toy_folder(tmp_path, monkeypatch)
    monkeypatch.setitem(backends.BACKENDS, "toy", "toy_backend.ENTRY")   # its one line
    monkeypatch.delenv("AIRFLOW_VAR_LLMOPS_BACKENDS", raising=False)
    return "toy"


def test_a_toy_backend_from_one_folder_and_one_line_is_picked_up_everywhere(toy, monkeypatch):
    # start_run refuses it without the settings its entry requires, before any job
    with pytest.raises(lifecycle.LifecycleParamError,
                       match=r"Param 'backend_pretrain' = 'toy', but the Airflow Variable "
                             r"'llmops_backends' has no staging_uri, queue for it \(key 'toy'\)"):
        lifecycle.start_run({"recipe": "tiny", "backend_pretrain": "toy"}, dag_id="toy_dag",
                            run_id="manual__refused")

    # its settings block is read from the Variable under its name, typed by its own class
    monkeypatch.setenv("AIRFLOW_VAR_LLMOPS_BACKENDS",
                       json.dumps({"toy": {"staging_uri": "s3://toy-bucket/stage", "queue": "q1"}}))
    block = backend_settings.load("toy", backend_settings.settings_class("toy"))
    assert (type(block).__name__, block.queue) == ("ToySettings", "q1")
    run = lifecycle.start_run({"recipe": "tiny", "backend_pretrain": "toy"}, dag_id="toy_dag",
                              run_id="manual__toy")
    assert run["backends"]["pretrain"] == "toy"

    # the job task's links: its own console, found by its own host discovery; its button
    handle = {"backend": "toy", "job_name": "pretrain-1", "toy_console": "https://toy.example"}
    assert links.links_for(handle, "http://mlflow/#/r") == {
        "Toy job": "https://toy.example/jobs/pretrain-1", "MLflow run": "http://mlflow/#/r"}
    assert "Toy job" in [link.name for link in links.job_links()]

    # a choice of the backend Params, and the class a job is submitted through
    assert "toy" in knobs.lifecycle_params()["backend_pretrain"].schema["enum"]
    assert type(backends.get_backend("toy")).__name__ == "ToyBackend"


def test_an_unregistered_folder_is_no_backend(tmp_path, monkeypatch):
    """The control: the same folder on sys.path without its line is refused by name."""
    toy_folder(tmp_path, monkeypatch)
    with pytest.raises(ValueError, match=r"Unknown backend 'toy'"):
        backends.get_backend("toy")
    assert links.links_for({"backend": "toy", "job_name": "j", "toy_console": "https://t"}) == {}
