"""Teams: which images, buckets, data, roles, queues and accelerator-hours each team's runs may use.

One MWAA environment and one set of backend settings (`llmops_backends`) serve many teams; the
Airflow Variable `llmops_teams` (JSON; locally `AIRFLOW_VAR_LLMOPS_TEAMS`) keeps each in its lane:

    {"default_team": "nlp",
     "teams": {
       "nlp": {"role_arn": "arn:aws:iam::123456789012:role/llmops-nlp",
               "image_prefixes": ["123456789012.dkr.ecr.us-east-1.amazonaws.com/nlp/"],
               "storage_prefixes": ["s3://llmops-nlp/runs/"],
               "data_prefixes": ["s3://corpora-nlp/"],
               "local_data_roots": [],
               "batch_share_identifier": "nlp",
               "hyperpod_namespace": "hyperpod-ns-nlp",
               "hyperpod_queue": "hyperpod-ns-nlp-localqueue",
               "priority": {"min": 0, "max": 500},
               "accelerator_hours_budget": 2000, "members": ["alice", "bob"]},
       "vision": {...}}}

Every key of a team is optional. A list key that is absent leaves that dimension to the
deployment-wide rules alone (LLMOPS_ALLOWED_STORAGE_ROOTS / DATA_ROOTS,
plugins/llmops/core/settings.py); a list that is present narrows them further (an empty list allows
nothing: `"local_data_roots": []` means the team reads no worker-local file). Both rules apply: a
path must pass the deployment's and the team's.

- `role_arn`: the IAM role the team's jobs run under: SageMaker and SageMaker Processing RoleArn,
  Batch jobRoleArn. It replaces the role in `llmops_backends`.
- `image_prefixes`: a stage's image (stage_resources.<stage>.image, else the backend settings'
  image) must start with one of them; each ends with '/', ':' or '@' so that a prefix cannot match
  another repository whose name merely begins the same way.
- `storage_prefixes`: where the run's storage_root may be (s3://bucket/prefix, or an absolute
  local directory for a one-machine deployment); the default storage root is checked too.
- `data_prefixes` (s3://) and `local_data_roots` (absolute directories): where data_inputs and
  sft_inputs may be read from (the recipe's own inputs count too).
- `batch_share_identifier`, `hyperpod_namespace`, `hyperpod_queue`: the team's AWS Batch fair
  share and HyperPod task-governance namespace and Kueue queue; they replace the run's team name
  (Batch) and the `namespace` / `queue_name` of the hyperpod settings. No two teams may share one.
- `priority`: {"min", "max"}, within Batch's 0-9999: the run's `priority` Param must be in range.
- `members`: the Airflow user names that may run as the team (the DAG run's triggering user;
  runs no person triggered, by a schedule or an asset event, pass); absent = anyone who may
  trigger the DAG.
- `accelerator_hours_budget`: accelerator-hours per calendar month (UTC), 0 or absent = no limit.
  Spent = the accelerator-hours the job ledger (plugins/llmops/infra/ledger/) recorded for the
  team's job attempts that ended this month (`spend_hours`); a run is refused when its estimate
  (plugins/llmops/policy/budget.py, `run_estimate`) exceeds budget - spent.

A run's `team` Param must name a configured team; empty = `default_team` (no default_team: the
team must be named). Without the Variable nothing changes: one implicit team, the team Param a
free label as before, no allowlists beyond the deployment's, no budget. Checked in `start_run`
(`check_run`, `check_budget`) before any job and before the MLflow parent run; the backends apply
the team's role, share, namespace and queue the run's job specs carry (`settings_overrides`).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

from llmops.core import paths, settings
from llmops.infra import ledger
from llmops.policy import budget

log = logging.getLogger(__name__)

VARIABLE = "llmops_teams"
TEAM_NAME = re.compile(r"^[a-z][a-z0-9]{0,30}$")   # the team Param's own pattern, non-empty
ROLE_ARN = re.compile(r"^arn:aws(-[a-z]+)*:iam::\d{12}:role/[\w+=,.@/-]{1,512}$")
S3_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
SHARE_IDENTIFIER = re.compile(r"^[A-Za-z0-9]{1,255}\*?$")   # AWS Batch's rule
K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
LISTS = ("image_prefixes", "storage_prefixes", "data_prefixes", "local_data_roots", "members")
# A backend settings field -> the team key that replaces it
# (plugins/llmops/jobs/backends/<backend>/<backend>_settings.py).
BACKEND_FIELDS: dict[str, dict[str, str]] = {
    "SageMakerSettings": {"role_arn": "role_arn"},
    "ProcessingSettings": {"role_arn": "role_arn"},
    "BatchSettings": {"job_role_arn": "role_arn", "share_identifier": "batch_share_identifier"},
    "HyperPodSettings": {"namespace": "hyperpod_namespace", "queue_name": "hyperpod_queue"},
}


class TeamError(ValueError):
    """The teams Variable is wrong, or a run is outside its team's lane; the message names the
    field, the team, the rule and the fix."""


@dataclass(frozen=True, kw_only=True)
class Team:
    name: str
    role_arn: str = ""
    image_prefixes: list | None = None
    storage_prefixes: list | None = None
    data_prefixes: list | None = None
    local_data_roots: list | None = None
    batch_share_identifier: str = ""
    hyperpod_namespace: str = ""
    hyperpod_queue: str = ""
    priority: dict = field(default_factory=dict)   # {"min": int, "max": int}
    accelerator_hours_budget: float = 0.0          # per calendar month (UTC); 0 = no limit
    members: list | None = None                    # Airflow user names; None = whoever can trigger

    def __post_init__(self) -> None:
        where = f"{VARIABLE}.teams.{self.name}"
        if not TEAM_NAME.match(self.name):
            raise TeamError(f"{VARIABLE}: team name {self.name!r} must be a lowercase letter, then up "
                            "to 30 lowercase letters and digits (the team Param's rule).")
        for key in ("role_arn", "batch_share_identifier", "hyperpod_namespace", "hyperpod_queue"):
            if not isinstance(getattr(self, key), str):
                raise TeamError(f"{where}.{key} must be a string, got {getattr(self, key)!r}.")
        if self.role_arn and not ROLE_ARN.match(self.role_arn):
            raise TeamError(f"{where}.role_arn {self.role_arn!r} is not an IAM role ARN; give "
                            "arn:aws:iam::<12-digit account>:role/<name>.")
        for key in LISTS:
            value = getattr(self, key)
            if value is not None and not (isinstance(value, list)
                                          and all(isinstance(v, str) and v.strip() for v in value)):
                raise TeamError(f"{where}.{key} must be a list of non-empty strings, got {value!r}.")
            for entry in value or []:
                _check_entry(where, key, entry)
        if self.batch_share_identifier and not SHARE_IDENTIFIER.match(self.batch_share_identifier):
            raise TeamError(f"{where}.batch_share_identifier {self.batch_share_identifier!r} must be "
                            "1-255 letters and digits (AWS Batch's rule).")
        for key in ("hyperpod_namespace", "hyperpod_queue"):
            if getattr(self, key) and not K8S_NAME.match(getattr(self, key)):
                raise TeamError(f"{where}.{key} {getattr(self, key)!r} must be a Kubernetes name: up "
                                "to 63 lowercase letters, digits and '-', starting and ending with a "
                                "letter or digit.")
        unknown = sorted(set(self.priority) - {"min", "max"}) if isinstance(self.priority, dict) else None
        if unknown is None or unknown:
            raise TeamError(f"{where}.priority must be an object with keys min and max, got "
                            f"{self.priority!r}.")
        lo, hi = self.priority_range
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)) \
                or not 0 <= lo <= hi <= 9999:
            raise TeamError(f"{where}.priority {self.priority!r}: min and max must be integers with "
                            "0 <= min <= max <= 9999 (AWS Batch's scheduling priorities).")
        budget = self.accelerator_hours_budget
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget < 0:
            raise TeamError(f"{where}.accelerator_hours_budget must be a number >= 0 "
                            f"(accelerator-hours per calendar month, 0 = no limit), got {budget!r}.")

    @property
    def priority_range(self) -> tuple[int, int]:
        return self.priority.get("min", 0), self.priority.get("max", 9999)


def _check_entry(where: str, key: str, entry: str) -> None:
    if key == "members":
        return
    if key == "image_prefixes":
        if entry[-1] not in "/:@" or "/" not in entry or any(c.isspace() for c in entry):
            raise TeamError(f"{where}.image_prefixes entry {entry!r} must name a registry and a "
                            "repository path and end with '/', ':' or '@' (e.g. "
                            "'123456789012.dkr.ecr.us-east-1.amazonaws.com/nlp/'), so that it "
                            "cannot match a repository that merely begins the same way.")
        return
    if entry.startswith("s3://"):
        bucket, _, rest = entry[5:].partition("/")
        if key == "local_data_roots" or not S3_BUCKET.match(bucket) \
                or any(p in (".", "..") for p in rest.split("/")):
            raise TeamError(f"{where}.{key} entry {entry!r} is not a valid "
                            f"{'local directory' if key == 'local_data_roots' else 's3://bucket/prefix'}.")
        return
    if key == "data_prefixes" or not os.path.isabs(entry) or ".." in entry.split(os.sep):
        kind = "an s3://bucket/prefix" if key == "data_prefixes" else (
            "an absolute local directory" if key == "local_data_roots"
            else "an s3://bucket/prefix or an absolute local directory")
        raise TeamError(f"{where}.{key} entry {entry!r} must be {kind} (no '..').")


@dataclass(frozen=True)
class Teams:
    teams: dict[str, Team]
    default_team: str = ""

    def __post_init__(self) -> None:
        if self.default_team and self.default_team not in self.teams:
            raise TeamError(f"{VARIABLE}.default_team {self.default_team!r} is not one of its teams "
                            f"({', '.join(sorted(self.teams)) or 'none'}). Add it, or name another.")
        for key in ("batch_share_identifier", "hyperpod_namespace", "hyperpod_queue"):
            owners: dict[str, str] = {}
            for team in self.teams.values():
                value = getattr(team, key)
                if value and value in owners:
                    raise TeamError(f"{VARIABLE}: teams {owners[value]} and {team.name} both have "
                                    f"{key} {value!r}; each team needs its own, or one would use "
                                    "the other's share of the cluster.")
                owners.setdefault(value, team.name)


def parse(data: Any) -> Teams:
    """The Variable's JSON value -> Teams, refusing unknown keys (naming the key and the team),
    wrong types, malformed ARNs, S3 prefixes and Kubernetes names."""
    if not isinstance(data, dict):
        raise TeamError(f"The Airflow Variable '{VARIABLE}' must be a JSON object with 'teams' "
                        "(and 'default_team').")
    unknown = sorted(set(data) - {"teams", "default_team"})
    if unknown:
        raise TeamError(f"Unknown key(s) {unknown} in the Airflow Variable '{VARIABLE}'. Known keys: "
                        "default_team, teams.")
    teams = data.get("teams") or {}
    if not isinstance(teams, dict):
        raise TeamError(f"{VARIABLE}.teams must be an object: team name -> its settings.")
    known = {f.name for f in fields(Team)} - {"name"}
    parsed = {}
    for name, block in teams.items():
        if not isinstance(block, dict):
            raise TeamError(f"{VARIABLE}.teams.{name} must be an object, got {block!r}.")
        unknown = sorted(set(block) - known)
        if unknown:
            raise TeamError(f"Unknown key(s) {unknown} for team {name!r} in the Airflow Variable "
                            f"'{VARIABLE}'. Known keys: {', '.join(sorted(known))}.")
        parsed[name] = Team(name=name, **block)
    default = data.get("default_team") or ""
    if not isinstance(default, str):
        raise TeamError(f"{VARIABLE}.default_team must be a team name, got {default!r}.")
    return Teams(parsed, default)


def load() -> Teams | None:
    """The Variable (else $AIRFLOW_VAR_LLMOPS_TEAMS outside a task); None when it is not set."""
    data = settings.variable_json(VARIABLE, TeamError)
    return None if data is None else parse(data)


def resolve(name: Any, teams: Teams | None = None) -> Team | None:
    """The run's team (empty = the default team); None when no teams are configured."""
    teams = teams if teams is not None else load()
    if teams is None:
        return None
    name = name or teams.default_team
    configured = ", ".join(sorted(teams.teams)) or "none"
    if not name:
        raise TeamError(f"Param 'team' is empty and the Airflow Variable '{VARIABLE}' has no "
                        f"default_team. Name your team (one of: {configured}), or have the platform "
                        "team set default_team.")
    if name not in teams.teams:
        default = f", or leave it empty for the default team '{teams.default_team}'" \
            if teams.default_team else ""
        raise TeamError(f"Param 'team' = {name!r} is not a team configured in the Airflow Variable "
                        f"'{VARIABLE}' (teams: {configured}). Pick your team{default}; a new team "
                        f"is added to {VARIABLE}.teams by the platform team. Nothing was started.")
    return teams.teams[name]


def settings_overrides(team_name: str) -> dict[str, dict[str, str]]:
    """The backend settings fields the team replaces (its role, fair share, namespace, queue),
    per settings class, for JobSpec.settings_overrides; {} without teams. A team no longer
    configured is refused."""
    team = resolve(team_name)
    if team is None:
        return {}
    overrides = {cls: {setting: getattr(team, key) for setting, key in keys.items() if getattr(team, key)}
                 for cls, keys in BACKEND_FIELDS.items()}
    return {cls: fields for cls, fields in overrides.items() if fields}


# -- a run inside its team's lane -----------------------------------------------------------

def _refuse(field_name: str, value: Any, team: Team, rule: str, allowed: Any, fix: str) -> None:
    raise TeamError(f"{field_name} {value!r} is not under team {team.name}'s {rule} {allowed} "
                    f"({VARIABLE}.teams.{team.name}.{rule}). {fix} Nothing was started.")


def check_run(params: dict[str, Any], cfg: Any, backends: dict[str, str], storage_root: str,
              user: str | None = None) -> Team | None:
    """Refuse what the run's team may not use: an unknown team, a user who is not one of its
    members (`user`: the DAG run's triggering user; None = no person, a schedule or an asset
    event), a priority out of range, a storage root, data input or remote stage's image outside
    the team's allowlists. Returns the team (None: no teams configured)."""
    team = resolve(params.get("team"))
    if team is None:
        return None
    ask = f"ask the platform team to add it to {VARIABLE}.teams.{team.name}"
    if user and team.members is not None and user not in team.members:
        raise TeamError(f"Param 'team' = {team.name!r}: user {user!r} is not one of team "
                        f"{team.name}'s members ({VARIABLE}.teams.{team.name}.members). Run as your "
                        f"own team, or {ask.replace('add it', 'add you')}. Nothing was started.")
    priority, (lo, hi) = params.get("priority"), team.priority_range
    if priority is not None and not (isinstance(priority, int) and lo <= priority <= hi):
        raise TeamError(f"Param 'priority' = {priority} is outside team {team.name}'s priority range "
                        f"{lo}-{hi} ({VARIABLE}.teams.{team.name}.priority). Give a priority from "
                        f"{lo} to {hi}, or leave it empty for the queue's default. Nothing was started.")
    if team.storage_prefixes is not None and not paths.under(storage_root, team.storage_prefixes):
        what = "Param 'storage_root'" if params.get("storage_root") else \
            "The default storage root (Param 'storage_root' is empty)"
        _refuse(what, storage_root, team, "storage_prefixes", team.storage_prefixes,
                "Set storage_root to a path under one of them, or " + ask + ".")
    for name, entries in (("data_inputs", cfg.data.inputs), ("sft_inputs", cfg.data.sft_inputs)):
        for entry in entries:
            remote = entry.startswith("s3://")
            rule = "data_prefixes" if remote else "local_data_roots"
            roots = getattr(team, rule)
            if roots is None:
                continue
            outside = (None if paths.under(paths.normal_s3(name, entry), roots) else entry) \
                if remote else paths.outside_roots(entry, roots)
            if outside is not None:
                source = f"Param '{name}'" if params.get(name) else f"The recipe's {name}"
                detail = "" if outside == entry else f" ({outside} resolves outside them)"
                _refuse(source + " entry", entry, team, rule, roots,
                        f"Read data from under one of them{detail}, or {ask}.")
    for stage, backend in backends.items():
        if backend == "local" or team.image_prefixes is None:
            continue
        image = budget.stage_resources(backend, stage, params)["image"]
        chosen = ((params.get("stage_resources") or {}).get(stage) or {}).get("image")
        source = f"stage_resources.{stage}.image" if chosen else \
            f"the {backend} settings' image in the Variable llmops_backends"
        if image and not any(image.startswith(p) for p in team.image_prefixes):
            _refuse(f"The {stage} stage's image ({source})", image, team, "image_prefixes",
                    team.image_prefixes, f"Use an image from one of them, or {ask}.")
    return team


# -- what the team has spent -----------------------------------------------------------------

def period_start(now: dt.datetime | None = None) -> dt.datetime:
    """The start of the budget period: the first of the current calendar month, 00:00 UTC."""
    now = now or dt.datetime.now(dt.timezone.utc)
    return now.astimezone(dt.timezone.utc).replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def spend_hours(team: str, since: dt.datetime) -> float:
    """Accelerator-hours the job ledger recorded for `team`'s job attempts that ended at or after
    `since` (an aware datetime): llmops.infra.ledger.spend_hours, the ledger's own answer (SQLite on
    this machine, Parquet under an s3:// storage root). Attempts still running are not in it yet."""
    return float(ledger.spend_hours(team, since))


def remaining_hours(team: Team, now: dt.datetime | None = None) -> tuple[float, float]:
    """(spent this period, remaining) for a team with a budget."""
    spent = spend_hours(team.name, period_start(now))
    return spent, team.accelerator_hours_budget - spent


def check_team(team: Team | None, estimates: list[budget.StageEstimate]) -> float:
    """Refuse a run whose estimate exceeds what its team has left this month (0 = no budget).
    Returns the run's estimate in accelerator-hours."""
    total = sum(e.hours for e in estimates)
    if team is None or not team.accelerator_hours_budget:
        return total
    spent, remaining = remaining_hours(team)
    if total <= remaining:
        return total
    since = period_start()
    next_month = (since + dt.timedelta(days=32)).replace(day=1)
    biggest = max(estimates, key=lambda e: e.hours)
    raise budget.BudgetError(
        f"Team {team.name}'s runs have {team.accelerator_hours_budget:g} accelerator-hours a month "
        f"({VARIABLE}.teams.{team.name}.accelerator_hours_budget); the job ledger records "
        f"{spent:.4g} spent since {since:%Y-%m-%d}, so {max(remaining, 0):.4g} remain, and this run "
        f"is estimated at {total:.4g}: " + "; ".join(e.line() for e in estimates) + ". "
        f"Lower stage_resources.{biggest.stage}.instance_count or max_run_seconds (the largest "
        f"stage), run stages on 'local', wait for the budget to renew on {next_month:%Y-%m-%d}, or "
        "ask the platform team to raise the budget. Nothing was started.")
