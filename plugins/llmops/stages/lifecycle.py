"""The lifecycle DAG's start: resolve and validate the run's settings (every Param, the backends,
the team and its budget, a reuse of an earlier run) before any job, and open the run
(`start_run`: its storage, the pinned champion, the MLflow parent run). Each stage's job spec is
built from the run in llmops.stages.specs; the gate is llmops.policy.promotion.

Cheap work only (no torch, no job): a refusal here costs nothing.
"""

from __future__ import annotations

import dataclasses
import difflib
import glob
import json
import logging
import os
import re
from typing import Any, get_type_hints

from llmops.core import settings
from llmops.infra import tracking
from llmops.jobs.backends import entry as backend_entry
from llmops.jobs.backends import backend_settings
from llmops.jobs.backends import remote_settings
from llmops.policy import model_refs, promotion, teams
from llmops.policy import params as lifecycle_params
from llmops.stages import reuse, specs
# the path checks start_run makes, named here too for the DAGs and scripts that call them
from llmops.core.paths import LifecycleParamError, check_data_path, check_storage_root  # noqa: F401
from llmops.core.paths import run_root
from llmops.core.run import Run
from llmops.policy import budget as sweep_budget
from tasks import configs

log = logging.getLogger(__name__)


def resolve(params: dict[str, Any]) -> configs.LifecycleConfig:
    """Recipe + the run's non-empty knobs -> a validated LifecycleConfig (paths still unset)."""
    try:
        cfg = configs.recipe(params.get("recipe") or "demo")
    except configs.ConfigError as exc:
        raise LifecycleParamError(f"Param 'recipe': {exc}") from None
    for name, path in lifecycle_params.KNOBS.items():
        value = params.get(name)
        if value is not None:
            lifecycle_params.set_path(cfg, path, value)
    # One tokenizer serves every model: keep vocab and context in step with data prep.
    for model in (cfg.pretrain.model, cfg.distill.student):
        model.vocab_size, model.block_size = cfg.data.vocab_size, cfg.data.seq_len
    cfg = _validated(configs.to_dict(cfg))
    for pattern in cfg.data.inputs + cfg.data.sft_inputs:
        if "://" not in pattern and not glob.glob(pattern):
            raise LifecycleParamError(
                f"Param 'data_inputs'/'sft_inputs': {pattern!r} matches no file. Give existing "
                "local paths or globs (JSONL or .txt), or leave empty for the demo data.")
    return cfg


def _validated(data: dict[str, Any]) -> configs.LifecycleConfig:
    """Build the LifecycleConfig; a refusal names the config path it is about (the student's
    n_embd is `distill.student.n_embd`, not "ModelConfig.n_embd") and the Param that sets it."""
    def check(cls: Any, value: dict[str, Any], path: str) -> None:
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):   # the deepest refusal is the one that says where
            if dataclasses.is_dataclass(hints[f.name]) and isinstance(value.get(f.name), dict):
                check(hints[f.name], value[f.name], f"{path}.{f.name}" if path else f.name)
        try:
            configs.from_dict(cls, value, where=f"{cls.__name__}")
        except configs.ConfigError as exc:
            raise LifecycleParamError(_name_the_field(str(exc), cls.__name__, path)) from None

    check(configs.LifecycleConfig, data, "")
    return configs.from_dict(configs.LifecycleConfig, data)


def _name_the_field(message: str, cls_name: str, path: str) -> str:
    """"ModelConfig.n_embd (31) must be ..." at distill.student -> "Param 'student_n_embd'
    (distill.student.n_embd): distill.student.n_embd (31) must be ...". """
    prefix = f"{path}." if path else ""
    message = re.sub(rf"\b{cls_name}\.", prefix, message)
    # a nested config's fields follow its path; a top-level one's message starts with its name
    fields = re.findall(rf"{re.escape(prefix)}([A-Za-z_][\w.]*)", message) if prefix else \
        re.findall(r"^([A-Za-z_]\w*)\b", message)
    by_path = {p: n for n, p in lifecycle_params.KNOBS.items()}
    paths = [f"{prefix}{f}".rstrip(".") for f in fields]
    names = [by_path[p] for p in paths if p in by_path]
    if not names:  # a field no Param sets: the recipe's value conflicts with a Param's
        return f"Invalid lifecycle parameters: {message} (a recipe value; pick another recipe or " \
               "change the Params that interact with it)."
    head = ", ".join(f"Param '{n}' ({lifecycle_params.KNOBS[n]})" for n in dict.fromkeys(names))
    return f"{head}: {message}"


# -- every input checked before any job -----------------------------------------------------

def declared_params() -> set[str]:
    return set(lifecycle_params.lifecycle_params())


def check_known_keys(keys: Any, declared: set[str], *, where: str = "the run's conf") -> None:
    """Refuse a key no Param declares (a typo is otherwise silently ignored), naming the nearest."""
    unknown = sorted(set(keys) - declared)
    if not unknown:
        return
    parts = []
    for key in unknown:
        near = difflib.get_close_matches(str(key), sorted(declared), n=1, cutoff=0.6)
        parts.append(f"'{key}'" + (f" (did you mean '{near[0]}'?)" if near else ""))
    raise LifecycleParamError(
        f"Unknown Param{'s' if len(unknown) > 1 else ''} in {where}: {', '.join(parts)}. Nothing was "
        f"started. The Params this DAG takes: {', '.join(sorted(declared))}.")


def check_params(params: dict[str, Any], conf: dict[str, Any] | None = None) -> str:
    """Everything about the run's Params that needs no config: unknown keys, paths. Returns the
    normalised storage root."""
    declared = declared_params()
    check_known_keys(conf or {}, declared)
    check_known_keys(params, declared, where="the run's Params")
    for name in ("data_inputs", "sft_inputs"):
        value = params.get(name)
        if value is None:
            continue
        if not isinstance(value, list):
            raise LifecycleParamError(f"Param '{name}' must be a list of paths, got {value!r}.")
        for entry in value:
            check_data_path(name, entry)
    check_suites(params.get("eval_suites"))
    return check_storage_root(params.get("storage_root"))


def check_suites(value: Any, *, name: str = "eval_suites") -> None:
    """Every task suite the run names exists, lies under the allowed data roots and is in the
    documented format (tasks.configs.SUITE_FORMATS), local or on S3 (read through the AWS
    connection): a bad line fails the run now, not after hours of training."""
    if value is None:
        return
    if not isinstance(value, list):
        raise LifecycleParamError(f"Param '{name}' must be a list of suite files, directories or "
                                  f"s3:// URIs, got {value!r}.")
    texts: dict[str, str] = {}   # where -> a suite file's text
    for entry in value:
        check_data_path(name, entry)
        if entry.startswith("s3://"):
            texts.update(_s3_suites(name, entry))
        elif os.path.isdir(entry):
            files = sorted(glob.glob(os.path.join(entry, "*.jsonl")))
            if not files:
                raise LifecycleParamError(f"Param '{name}': {entry!r} holds no *.jsonl suite files.")
            texts.update({f: open(f, encoding="utf-8").read() for f in files})
        elif os.path.isfile(entry):
            texts[entry] = open(entry, encoding="utf-8").read()
        else:
            raise LifecycleParamError(f"Param '{name}': {entry!r} does not exist. Give suite files "
                                      "(JSONL), directories of them, or s3:// URIs.")
    stems = [os.path.splitext(os.path.basename(where))[0] for where in texts]
    twice = sorted({s for s in stems if stems.count(s) > 1})
    if twice:
        raise LifecycleParamError(f"Param '{name}': suites are named by their file's stem, and "
                                  f"{twice} would be two suites of one name. Rename one.")
    for where, text in texts.items():
        try:
            configs.check_suite_text(text, where)
        except configs.ConfigError as exc:
            raise LifecycleParamError(f"Param '{name}': {exc} The format: {configs.SUITE_FORMATS}. "
                                      "Nothing was started.") from None


MAX_SUITE_BYTES = 64 << 20


def _s3_suites(name: str, uri: str) -> dict[str, str]:
    """The suite file(s) at `uri` (a .jsonl key, or the .jsonl objects under the prefix), read
    through the AWS connection with a short timeout, as the evaluation job will find them."""
    from botocore.config import Config

    from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook
    from tasks.common.uris import split_s3

    config = Config(connect_timeout=CHECK_TIMEOUT_SECONDS, read_timeout=CHECK_TIMEOUT_SECONDS,
                    retries={"max_attempts": 2, "mode": "standard"})
    bucket, key = split_s3(uri)
    try:
        s3 = AwsBaseHook(aws_conn_id=settings.aws_conn_id(), client_type="s3", config=config).conn
        if key.endswith(".jsonl"):
            keys = [key]
        else:
            prefix = key.rstrip("/") + "/" if key else ""
            listed = s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
            keys = sorted(o["Key"] for o in listed
                          if o["Key"].endswith(".jsonl") and "/" not in o["Key"][len(prefix):])
        found = {}
        for k in keys:
            head = s3.head_object(Bucket=bucket, Key=k)
            if head["ContentLength"] > MAX_SUITE_BYTES:
                raise LifecycleParamError(f"Param '{name}': s3://{bucket}/{k} is "
                                          f"{head['ContentLength']:,} bytes, over the "
                                          f"{MAX_SUITE_BYTES >> 20} MiB a suite may hold.")
            found[f"s3://{bucket}/{k}"] = s3.get_object(Bucket=bucket, Key=k)["Body"].read().decode()
    except LifecycleParamError:
        raise
    except Exception as exc:  # ClientError (404, 403), BotoCoreError, a missing connection
        raise LifecycleParamError(f"Param '{name}': {uri} could not be read through AWS connection "
                                  f"'{settings.aws_conn_id()}' ({exc}). Check the URI and the "
                                  "connection. Nothing was started.") from None
    if not found:
        raise LifecycleParamError(f"Param '{name}': {uri} holds no .jsonl suite objects.")
    return found


CHECK_TIMEOUT_SECONDS = 5


def check_backends(backends: dict[str, str], params: dict[str, Any], storage_root: str,
                   *, network: bool = True) -> None:
    """Each remote stage's settings block has what its backend needs, and (where an AWS
    connection is configured) the connection answers and the staging and storage buckets exist."""
    resources = params.get("stage_resources") or {}
    buckets: dict[str, set[str]] = {}   # aws_conn_id -> buckets to check through it
    for stage, backend in backends.items():
        entry = backend_entry(backend)   # what it requires is in its folder (llmops.jobs.backends)
        if not entry.settings:            # runs here: no settings block to check
            continue
        knob = f"backend_{stage}"
        try:
            block = backend_settings.load(backend, backend_settings.settings_class(backend)).for_stage(stage)
        except remote_settings.BackendSettingsError as exc:
            raise LifecycleParamError(f"Param '{knob}' = {backend!r}: {exc}") from None
        chosen = resources.get(stage) or {}
        missing = [k for k in entry.required
                   if not (chosen.get(k) if k in ("image", "instance_type") else None)
                   and not getattr(block, k)]
        if entry.one_of and not any(getattr(block, k) for k in entry.one_of):
            missing.append(entry.one_of[0])
        if missing:
            example = {backend: {k: remote_settings.EXAMPLES.get(k, "...") for k in missing}}
            raise LifecycleParamError(
                f"Param '{knob}' = {backend!r}, but the Airflow Variable "
                f"'{remote_settings.VARIABLE}' has no {', '.join(missing)} for it (key "
                f"'{backend}'{', or stage_resources.' + stage + '.image' if 'image' in missing else ''}"
                f"). Add them, e.g. {json.dumps(example)}, or set {knob} to 'local'. "
                "Nothing was started.")
        if not block.staging_uri.startswith("s3://"):
            raise LifecycleParamError(f"Param '{knob}' = {backend!r}: the {backend} settings' "
                                      f"staging_uri must be an s3:// prefix, got {block.staging_uri!r}.")
        if entry.aws:
            buckets.setdefault(block.aws_conn_id, set()).add(block.staging_uri[5:].split("/")[0])
    if storage_root.startswith("s3://"):
        conn = next(iter(buckets), settings.aws_conn_id())
        buckets.setdefault(conn, set()).add(storage_root[5:].split("/")[0])
    if network:
        for conn_id, names in buckets.items():
            _check_aws(conn_id, sorted(names), storage_root)


def _check_aws(conn_id: str, buckets: list[str], storage_root: str) -> None:
    """STS GetCallerIdentity and HeadBucket through the connection, each with a short timeout."""
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook

    config = Config(connect_timeout=CHECK_TIMEOUT_SECONDS, read_timeout=CHECK_TIMEOUT_SECONDS,
                    retries={"max_attempts": 1, "mode": "standard"})
    try:
        AwsBaseHook(aws_conn_id=conn_id, client_type="sts", config=config).conn.get_caller_identity()
    except Exception as exc:  # ClientError, BotoCoreError, a missing connection
        raise LifecycleParamError(
            f"AWS connection '{conn_id}' does not work: GetCallerIdentity failed ({exc}). Check the "
            "connection's credentials, region and endpoint (or the execution role), or run the "
            "stages locally. Nothing was started.") from None
    s3 = AwsBaseHook(aws_conn_id=conn_id, client_type="s3", config=config).conn
    for bucket in buckets:
        try:
            s3.head_bucket(Bucket=bucket)
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            what = {"404": "does not exist", "NoSuchBucket": "does not exist",
                    "403": "is not readable through it (access denied)"}.get(code, f"failed ({exc})")
            used = "storage_root" if storage_root.startswith(f"s3://{bucket}") else "staging_uri"
            raise LifecycleParamError(
                f"S3 bucket '{bucket}' (from {used}) {what}, checked through AWS connection "
                f"'{conn_id}'. Create it, or fix {used}. Nothing was started.") from None
        except (BotoCoreError, OSError) as exc:
            raise LifecycleParamError(f"S3 bucket '{bucket}' could not be checked through AWS "
                                      f"connection '{conn_id}' ({exc}). Nothing was started.") from None


def start_run(params: dict[str, Any], *, dag_id: str, run_id: str,
              conf: dict[str, Any] | None = None, user: str | None = None) -> dict[str, Any]:
    """Check every input (before any job, before the MLflow parent run), fix this run's storage
    paths, open the parent run, and pin the current champion (by version) for the run's
    evaluation. `conf` is the DAG run's conf as triggered: a key no Param declares is refused
    (Airflow drops it from `params` silently); `user` its triggering user (a team's members).
    Returns the Run as its XCom dict (Run.to_dict), what the DAG's start_run task returns."""
    storage_root = check_params(params, conf)
    cfg = resolve(params)
    base_model = model_refs.check_run_models(params, cfg)  # the models a run names, and their tokenizer
    backends = {stage: params.get(f"backend_{stage}") or "local" for stage in lifecycle_params.STAGES}
    sweep_budget.check_sweep(cfg, backends["sweep"], params)  # refuse before any job starts
    check_backends(backends, params, storage_root, network=False)  # the settings, naming the Param
    team = check_lane(params, cfg, backends, storage_root, user)
    check_backends(backends, params, storage_root)
    root = run_root(storage_root, dag_id, run_id)
    config = configs.to_dict(cfg)
    earlier = reuse.check(params, config, dag_id)   # from_run + start_at: its outputs, checked
    check_fork(config, earlier)
    if earlier and earlier.get("fork"):
        earlier["fork"].pop("config")   # checked; the run dict travels through XCom
    parent = tracking.start_parent_run(experiment=dag_id, dag_id=dag_id, run_id=run_id,
                                       config={**config, "backends": backends, "root": root},
                                       # named on the run page from the start, not at promote
                                       tags={"recipe": params.get("recipe") or "demo"})
    try:
        reuse.tag_parent(parent, earlier, conf)
        model_name = params.get("registered_model_name") or "llm-lifecycle"
        # Read once per DAG run: if evaluate read it at execute time, a champion crowned between
        # two tries would change its config, hence its job name, and the retry would start a
        # second job.
        champion = promotion.current_champion(model_name)
    except Exception as exc:
        fail_parent_run(parent, f"start_run: {exc}")
        raise
    return Run(dag_id=dag_id, run_id=run_id, root=root, config=config,
               champion=promotion.pin(champion),
               backends=backends, experiment=dag_id, parent_run_id=parent,
               resources=params.get("stage_resources") or {},
               team=team.name if team else params.get("team") or "",
               priority=params.get("priority"),
               model_name=model_name, base_model=base_model,
               base_model_hash=model_refs.content_hash(base_model) if base_model else "",
               storage_root=storage_root, cache=params.get("cache", True) is not False,
               from_run=earlier).to_dict()


def check_lane(params: dict[str, Any], cfg: configs.LifecycleConfig, backends: dict[str, str],
               storage_root: str, user: str | None = None) -> teams.Team | None:
    """The run's team (the `llmops_teams` Variable, plugins/llmops/policy/teams.py): refuse what is
    outside its allowlists, then an estimate of every stage over what is left of its budget.
    The first task of every DAG calls it before any job; None when no teams are configured."""
    team = teams.check_run(params, cfg, backends, storage_root, user)
    hours = teams.check_team(team, sweep_budget.run_estimate(cfg, backends, params))
    log.info("Estimate: %.4g accelerator-hours for team %s", hours, team.name if team else "-")
    return team


def fail_parent_run(parent_run_id: str, reason: str) -> None:
    """End the DAG run's parent run FAILED with the reason as the `failure_reason` tag."""
    try:
        c = tracking.client()
        c.set_tag(parent_run_id, "failure_reason", reason[:5000])
        tracking.end_run(parent_run_id, "FAILED")
    except Exception:  # the refusal itself matters more than its bookkeeping
        log.exception("Could not mark MLflow run %s failed", parent_run_id)


# What start_run raises for input a retry cannot fix: the DAG fails the task without retrying.
def validation_errors() -> tuple[type[Exception], ...]:
    return (LifecycleParamError, sweep_budget.BudgetError, remote_settings.BackendSettingsError,
            configs.ConfigError, teams.TeamError, reuse.FromRunError)


def check_fork(config: dict[str, Any], earlier: dict[str, Any] | None) -> None:
    """A fork (fork_step) may change only tasks.configs.FORK_KNOBS of the pretraining it forks:
    refuse anything else by name before any job (the job checks again)."""
    fork = (earlier or {}).get("fork")
    if not fork:
        return
    ours = specs.pretrain_config(config, earlier.get("sweep_best") or {})
    refused = [reuse.changed_setting(f"pretrain.{key}", was, now)
               for key, (was, now) in configs.fork_refusals(fork["config"], ours).items()]
    if refused:
        raise reuse.FromRunError(
            f"Param 'fork_step': a fork of run {earlier['run_id']}'s pretraining may change only "
            f"its learning rate and schedule, pretrain_steps and the guard's settings; this run "
            f"differs in {'; '.join(refused)}. Set them as that run had them. Nothing was started.")
