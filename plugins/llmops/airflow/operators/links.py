"""Buttons on a job task's page: its MLflow run, and where its job runs and logs (the SageMaker,
Batch, EKS and CloudWatch consoles, the Ray dashboard); on the pretrain task, "Pause pretraining".

How Airflow 3 shows an extra link: the serialized DAG keeps only each link's name and `xcom_key`,
and the API server shows the XCom stored under that key (it never runs `get_link`). The worker
fills those keys twice:

- `push_links` (called by JobOperator as soon as the job's handle is known, on submit or on
  reattach) stores every URL under its link's key at once, so the buttons work while a
  days-long job runs, and the URLs themselves under `LINKS_KEY`;
- when the try ends, Airflow's task runner calls each link's `get_link`, which reads `LINKS_KEY`
  back and stores the same URL again.

Which buttons there are and what they open is the backends' to say: each entry in
llmops.jobs.backends.BACKENDS names its buttons and gives its links (and how it finds its console
or dashboard); this module adds the MLflow run's and the pause page's. A link that does not apply
to the task's backend stays empty (a greyed-out button). A new try starts with its XComs cleared;
its submit or reattach pushes the links again.
"""

from __future__ import annotations

import logging
import re
from typing import Any, ClassVar

from airflow.sdk import BaseOperatorLink
from airflow.sdk.execution_time.xcom import XCom  # the configured XCom backend

from llmops.jobs import backends

log = logging.getLogger(__name__)

# XCom key of the dict {link name: URL} that push_links writes and every get_link reads.
LINKS_KEY = "llmops_links"


class _JobLink(BaseOperatorLink):
    """One entry of the LINKS_KEY dict; the subclasses only name it."""

    name: ClassVar[str]

    @property
    def xcom_key(self) -> str:
        return f"_link_{self.__class__.__name__}"

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        try:
            links = XCom.get_value(ti_key=ti_key, key=LINKS_KEY)
        except Exception:  # noqa: BLE001 - a link must never fail the task or the page
            log.debug("no %s for %s", LINKS_KEY, ti_key, exc_info=True)
            return ""
        return str((links or {}).get(self.name) or "")


class MLflowRunLink(_JobLink):
    name = "MLflow run"


class PausePretrainingLink(_JobLink):
    """The lifecycle's pretrain task only: its run's pause page (llmops.airflow.pause_api)."""

    name = "Pause pretraining"


def button(name: str) -> _JobLink:
    """The link class of a backend's button, named after it ("Batch job" -> BatchJobLink: its
    XCom key is _link_BatchJobLink)."""
    words = re.findall(r"[A-Za-z0-9]+", name)
    cls_name = "".join(w[:1].upper() + w[1:] for w in words) + "Link"
    return type(cls_name, (_JobLink,), {"name": name, "__module__": __name__})()


def job_links() -> tuple[_JobLink, ...]:
    """Every job task's buttons: its MLflow run, each registered backend's (in registry order,
    once each), the pause page."""
    names = dict.fromkeys(name for backend in backends.BACKENDS
                          for name in backends.entry(backend).buttons)
    return (MLflowRunLink(), *(button(name) for name in names), PausePretrainingLink())


JOB_LINKS = job_links()


def link_named(name: str) -> _JobLink:
    """The button of that name among JOB_LINKS."""
    return next(link for link in JOB_LINKS if link.name == name)


# -- the worker side -------------------------------------------------------------------------------


def _entry(handle: dict[str, Any]) -> backends.BackendEntry | None:
    name = handle.get("backend") or ""
    return backends.entry(name) if name in backends.BACKENDS else None


def backend_links(handle: dict[str, Any], host: str) -> dict[str, str]:
    """The console / dashboard links of one job handle, from its backend's entry; `host` is where
    that backend's console is (its region, its dashboard)."""
    entry = _entry(handle)
    return entry.links(handle, host) if entry and entry.links and host else {}


def job_host(handle: dict[str, Any]) -> str:
    """Where the job's console or dashboard is, as its backend finds it; "" when it cannot."""
    entry = _entry(handle)
    if entry is None or entry.host is None:
        return ""
    try:
        return entry.host(handle)
    except Exception:  # noqa: BLE001 - no host, no console link; a link never fails the task
        log.debug("no console host for %s", handle.get("job_name"), exc_info=True)
        return ""


def links_for(handle: dict[str, Any], mlflow_run: str = "") -> dict[str, str]:
    """Every link of a job task: `mlflow_run` (a URL) and the backend's."""
    links = backend_links(handle, job_host(handle))
    if mlflow_run:
        links[MLflowRunLink.name] = mlflow_run
    return links


def push_links(ti: Any, links: dict[str, str]) -> None:
    """Store the links where the UI reads them (see the module docstring)."""
    ti.xcom_push(key=LINKS_KEY, value=links)
    for link in JOB_LINKS:
        if links.get(link.name):
            ti.xcom_push(key=link.xcom_key, value=links[link.name])
