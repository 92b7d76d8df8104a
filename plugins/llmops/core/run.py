"""A DAG run as its tasks see it: what start_run resolved once (configs, storage, team, the
champion pin, the MLflow ids), handed to every stage's spec builder.

It travels between tasks as XCom, hence as JSON: `Run.to_dict()` is the dict the start task
returns, `Run.of(xcom)` what a task makes of it. `from_dict` refuses a key it does not know and a
missing one that every run has, by name, so a renamed or misspelt key fails where it is read,
not as a silent default three stages later.

Three DAGs make runs: the lifecycle (lifecycle.start_run: every field), the retraining DAG
(retraining.start_retrain: no sweep, its curated `data` instead of a data prep stage) and the
scaling ladder (sweep.ladder.start_ladder: no model, no champion). The keys those two lack, and
that the XCom of a run started by an older deployment may lack, have defaults.

Standard library only: every layer from the step cache up reads it.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Run:
    # -- what every run has --
    # the DAG and DAG run: the study's name, the registered version's lineage, the run summary
    dag_id: str
    run_id: str
    # this run's storage prefix (<storage_root>/<dag_id>/<run_id>): every stage writes under it
    root: str
    # the resolved LifecycleConfig as a dict (tasks.configs.to_dict): each stage's job config
    # is cut from it, so a retry builds the same job whatever the recipe says by then
    config: dict[str, Any]
    # stage -> backend name ("local", "sagemaker", ...): where each stage's job runs
    backends: dict[str, str]
    # the MLflow experiment and the DAG run's parent run: every job's run is its child
    experiment: str
    parent_run_id: str

    # -- what older XComs and the other DAGs' runs may lack --
    # the champion's version pinned at start (promotion.pin; None: there was none), so every try
    # of evaluation compares with the same model; see champion_pinned
    champion: dict[str, Any] | None = None
    # False for a run started before champions were pinned: evaluation reads the current one.
    # Not a key of its own: to_dict then leaves `champion` out, as that run's XCom did
    champion_pinned: bool = True
    # stage -> JobSpec fields (instance type, count, image...): the Param stage_resources
    resources: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    # the team (cost tags, the team's role and queue on remote backends) and the scheduling
    # priority (Batch, HyperPod); "" and None: none asked for
    team: str = ""
    priority: int | None = None
    # the registered model the gate registers to and whose champion is pinned
    model_name: str = ""
    # a model to fine-tune instead of pretraining (Param base_model) and its content hash, the
    # step cache's key for it; "" when the run pretrains its own
    base_model: str = ""
    base_model_hash: str = ""
    # the storage root the step cache's index lives under ("": no cache) and whether to look
    # there (Param cache)
    storage_root: str = ""
    cache: bool = True
    # the earlier run this one takes stages from (reuse.check: from_run, start_at, fork_step)
    from_run: dict[str, Any] | None = None
    # the retraining DAG's curated data, shaped like a data prep result (it has no data prep
    # stage); None for the other DAGs, and then not a key of to_dict
    data: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The XCom: a JSON-able dict with one key per field (a lifecycle run's: exactly what
        start_run has always returned)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in _NOT_KEYS}
        if not self.champion_pinned:
            del out["champion"]
        if self.data is None:
            del out["data"]
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Run:
        """The run a task was handed as XCom; an unknown key or a missing required one is refused
        by name."""
        known = {f.name for f in dataclasses.fields(cls)} - _NOT_KEYS
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"Run: unknown key{'s' if len(unknown) > 1 else ''} "
                             f"{', '.join(repr(k) for k in unknown)} (a run has {', '.join(sorted(known))})")
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.name in known and f.name not in d and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ValueError(f"Run: missing key{'s' if len(missing) > 1 else ''} "
                             f"{', '.join(repr(k) for k in missing)}")
        return cls(**d, champion_pinned="champion" in d)

    @classmethod
    def of(cls, run: Run | dict[str, Any]) -> Run:
        """A Run from what a task was given: the XCom dict, or a Run already."""
        return run if isinstance(run, cls) else cls.from_dict(run)


_NOT_KEYS = frozenset({"champion_pinned"})   # fields that say how to_dict writes, not keys
