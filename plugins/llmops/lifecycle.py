"""What the lifecycle DAG's tasks do on the Airflow side: resolve and validate the run's settings,
build each stage's job spec from upstream results, choose the best trial, and promote a model.

Cheap work only (no torch): the heavy lifting happens in the jobs these specs describe.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import glob
import json
import logging
import os
import re
from typing import Any, get_type_hints

from llmops import params as lifecycle_params
from llmops import model_refs, promotion
from llmops import reuse, settings, step_cache, teams, tracking
from llmops.jobs.backends import remote_settings
from llmops.jobs.backends import settings as backend_settings
from llmops.jobs.spec import JobSpec, NothingToRun
# the path checks start_run makes, named here too for the DAGs and scripts that call them
from llmops.paths import LifecycleParamError, check_data_path, check_storage_root  # noqa: F401
from llmops.run import Run
from llmops.sweep import budget as sweep_budget
from llmops.sweep import stage as sweep_stage
from llmops.sweep import study as studies
from tasks import configs

log = logging.getLogger(__name__)

ENTRYPOINTS = {
    "data_prep": "tasks.data.prep",
    "sweep": "tasks.sweep",
    "pretrain": "tasks.pretrain",
    "finetune": "tasks.finetune",
    "distill": "tasks.distill",
    "distill_cache": "tasks.distill_cache",
    "evaluate": "tasks.evaluate",
}


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
    return check_storage_root(params.get("storage_root"))


# The settings each remote backend cannot submit without, beyond what for_stage checks.
REQUIRED_SETTINGS: dict[str, tuple[str, ...]] = {
    "sagemaker": ("role_arn", "staging_uri", "image"),
    "sagemaker_processing": ("role_arn", "staging_uri", "image", "instance_type"),
    "batch": ("job_queue", "staging_uri", "image"),
    "hyperpod": ("staging_uri", "image"),
    "ray": ("staging_uri",),
}
AWS_BACKENDS = ("sagemaker", "sagemaker_processing", "batch", "hyperpod", "ray")
CHECK_TIMEOUT_SECONDS = 5


def check_backends(backends: dict[str, str], params: dict[str, Any], storage_root: str,
                   *, network: bool = True) -> None:
    """Each remote stage's settings block has what its backend needs, and (where an AWS
    connection is configured) the connection answers and the staging and storage buckets exist."""
    resources = params.get("stage_resources") or {}
    buckets: dict[str, set[str]] = {}   # aws_conn_id -> buckets to check through it
    for stage, backend in backends.items():
        if backend == "local":
            continue
        knob = f"backend_{stage}"
        try:
            block = backend_settings.load(backend, backend_settings.settings_class(backend)).for_stage(stage)
        except remote_settings.BackendSettingsError as exc:
            raise LifecycleParamError(f"Param '{knob}' = {backend!r}: {exc}") from None
        chosen = resources.get(stage) or {}
        missing = [k for k in REQUIRED_SETTINGS[backend]
                   if not (chosen.get(k) if k in ("image", "instance_type") else None)
                   and not getattr(block, k)]
        if backend == "hyperpod" and not (block.eks_cluster_name or block.kubernetes_conn_id):
            missing.append("eks_cluster_name")
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
        if backend in AWS_BACKENDS:
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
    root = os.path.join(storage_root, dag_id, re.sub(r"[^A-Za-z0-9_.-]+", "_", run_id))
    config = configs.to_dict(cfg)
    earlier = reuse.check(params, config, dag_id)   # from_run + start_at: its outputs, checked
    check_fork(config, earlier)
    if earlier and earlier.get("fork"):
        earlier["fork"].pop("config")   # checked; the run dict travels through XCom
    parent = tracking.start_parent_run(experiment=dag_id, dag_id=dag_id, run_id=run_id,
                                       config={**config, "backends": backends, "root": root})
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
    """The run's team (the `llmops_teams` Variable, plugins/llmops/teams.py): refuse what is
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


def _spec(run: Run, stage: str, config: dict[str, Any], *,
          data_hash: str = "", lineage: dict[str, str] | None = None,
          inputs: dict[str, tuple[str, str]] | None = None) -> dict[str, Any]:
    """The stage's JobSpec as a dict; `inputs` (name -> (path, content hash)) is what the step
    cache keys on besides the config (llmops.step_cache)."""
    # Team and priority travel as tags: cost allocation everywhere, and the fair-share identifier
    # and scheduling priority where the backend schedules (Batch, HyperPod).
    scheduling = {"team": run.team or ""}
    if run.priority is not None:
        scheduling["priority"] = str(run.priority)
    backend = run.backends[stage]
    return JobSpec(
        stage=stage, entrypoint=ENTRYPOINTS[stage], config=config, backend=backend,
        output_uri=config.get("output_dir", ""), mlflow_experiment=run.experiment,
        mlflow_parent_run_id=run.parent_run_id,
        tags={"data_hash": data_hash, **(lineage or {}), **{k: v for k, v in scheduling.items() if v}},
        cache=step_cache.for_spec(run, stage, inputs),
        # the remote backends submit with the team's role, share, namespace and queue
        settings_overrides={} if backend == "local" else teams.settings_overrides(run.team or ""),
        **(run.resources or {}).get(stage, {}),
    ).to_dict()


def _data_input(data: dict[str, Any]) -> tuple[str, str]:
    """A data prep result as a step-cache input: its directory and its manifest's hash."""
    return data["outputs"]["data_dir"], data.get("data_hash", "")


def _model_input(result: dict[str, Any]) -> tuple[str, str]:
    """A training stage's result as a step-cache input: its model directory and content hash."""
    return result["outputs"]["model_dir"], (result.get("content_hashes") or {}).get("model_dir", "")


def _out(run: Run, *parts: str) -> str:
    return os.path.join(run.root, *parts)


def data_prep_spec(run: Run | dict[str, Any]) -> dict[str, Any]:
    run = Run.of(run)
    config = {**run.config["data"], "output_dir": _out(run, "data_prep")}
    raw = step_cache.raw_inputs_hash(config["inputs"] + config["sft_inputs"]) \
        if run.storage_root and not reuse.taken(run, "data_prep") else ""
    return _spec(run, "data_prep", config, inputs={"raw": ("", raw)})


def sweep_trials(run: Run | dict[str, Any], data: dict[str, Any]) -> list[dict[str, Any]]:
    """Open the run's Optuna study; one op_kwargs dict per slot, for
    `TrialOperator.partial(...).expand(op_kwargs=...)` (plugins/llmops/sweep). None with a
    base_model: nothing is pretrained."""
    run = Run.of(run)
    if run.base_model:
        return []
    return sweep_stage.plan_trials(run, data)


def trial_spec(run: Run | dict[str, Any], data: dict[str, Any], study: dict[str, Any], slot: int,
               trial: dict[str, Any]) -> dict[str, Any]:
    """One trial: a short pretraining run with the trial's hyperparameters, evaluated (and
    checkpointed, so a retry resumes) at every point where the study's pruner may stop it."""
    run = Run.of(run)
    steps, every = study["steps"], study["eval_interval"]
    config = copy.deepcopy(run.config["pretrain"])
    config.update(data_dir=data["outputs"]["data_dir"],
                  output_dir=_out(run, "sweep", f"trial-{trial['number']}"),
                  max_steps=steps, checkpoint_interval=every, eval_interval=every)
    config["optim"]["warmup_steps"] = min(config["optim"]["warmup_steps"], steps // 5)
    sweep_stage.apply_best(config, {"params": trial["params"]})
    spec = _spec(run, "sweep", config, data_hash=data["data_hash"],
                 lineage={"trial": str(trial["number"]), "slot": str(slot), "study": study["name"]},
                 inputs={"data": _data_input(data)})
    spec["env"] = {**spec["env"], **studies.job_env(study, trial["number"], spec["backend"])}
    return spec


def pretrain_config(config: dict[str, Any], best: dict[str, Any]) -> dict[str, Any]:
    """The lifecycle config's pretraining with the best trial's hyperparameters (and ladder size);
    a pretrain_lr the run sets wins over the sweep's."""
    pretrain = copy.deepcopy(config["pretrain"])
    sweep_stage.apply_best(pretrain, best)
    if config.get("pretrain_lr"):
        pretrain["optim"]["lr"] = config["pretrain_lr"]
    return pretrain


def pretrain_spec(run: Run | dict[str, Any], data: dict[str, Any], best: dict[str, Any]
                  ) -> dict[str, Any]:
    """Pretraining's job; with fork_step, a fork of from_run's pretraining at that step
    (tasks/train/fork.py), its checkpoint an input of the step cache."""
    run = Run.of(run)
    config = pretrain_config(run.config, best)
    config.update(data_dir=data["outputs"]["data_dir"], output_dir=_out(run, "pretrain"))
    inputs, lineage = {"data": _data_input(data)}, {"sweep_best_run_id": best.get("mlflow_run_id", "")}
    fork = (run.from_run or {}).get("fork")
    if fork:
        config.update(fork_from=fork["checkpoints"], fork_step=fork["step"],
                      fork_parent_run_id=fork["parent_run_id"])
        inputs["fork"] = (fork["checkpoints"], fork["hash"])
        lineage.update({"fork.parent_run_id": fork["parent_run_id"], "fork.step": str(fork["step"])})
    return _spec(run, "pretrain", config, data_hash=data["data_hash"], lineage=lineage,
                 inputs=inputs)


def check_fork(config: dict[str, Any], earlier: dict[str, Any] | None) -> None:
    """A fork (fork_step) may change only tasks.configs.FORK_KNOBS of the pretraining it forks:
    refuse anything else by name before any job (the job checks again)."""
    fork = (earlier or {}).get("fork")
    if not fork:
        return
    ours = pretrain_config(config, earlier.get("sweep_best") or {})
    refused = [reuse.changed_setting(f"pretrain.{key}", was, now)
               for key, (was, now) in configs.fork_refusals(fork["config"], ours).items()]
    if refused:
        raise reuse.FromRunError(
            f"Param 'fork_step': a fork of run {earlier['run_id']}'s pretraining may change only "
            f"its learning rate and schedule, pretrain_steps and the guard's settings; this run "
            f"differs in {'; '.join(refused)}. Set them as that run had them. Nothing was started.")


def finetune_spec(run: Run | dict[str, Any], data: dict[str, Any], base: dict[str, Any] | None
                  ) -> dict[str, Any]:
    """Fine-tune the pretrained model, or the run's base_model (pretraining skipped: base None)."""
    run = Run.of(run)
    base = base or given_base(run)
    config = {**run.config["finetune"], "base_model": base["outputs"]["model_dir"],
              "data_dir": data["outputs"]["data_dir"], "output_dir": _out(run, "finetune")}
    return _spec(run, "finetune", config, data_hash=data["data_hash"],
                 lineage={"base_run_id": base.get("mlflow_run_id", "")},
                 inputs={"data": _data_input(data), "base": _model_input(base)})


def distill_spec(run: Run | dict[str, Any], data: dict[str, Any], teacher: dict[str, Any],
                 cache: dict[str, Any] | None = None) -> dict[str, Any]:
    """The student's job; with `cache` (teacher_cache_spec's result) it reads the teacher's
    cached logits instead of running the teacher."""
    run = Run.of(run)
    config = {**run.config["distill"], "teacher_model": teacher["outputs"]["model_dir"],
              "data_dir": data["outputs"]["data_dir"], "output_dir": _out(run, "distill")}
    if cache:
        config["teacher_cache"] = cache["outputs"]["teacher_cache"]
    return _spec(run, "distill", config, data_hash=data["data_hash"],
                 lineage={"teacher_run_id": teacher.get("mlflow_run_id", "")},
                 inputs={"data": _data_input(data), "teacher": _model_input(teacher)})


def teacher_cache_spec(run: Run | dict[str, Any], data: dict[str, Any], teacher: dict[str, Any]
                       ) -> dict[str, Any]:
    """The teacher's top-k logits job (tasks.distill_cache), on the distill stage's backend, from
    the same DistillConfig the student's job will get."""
    run = Run.of(run)
    spec = distill_spec(run, data, teacher)
    spec["config"]["teacher_cache"] = _out(run, "teacher_cache")
    return {**spec, "stage": "distill_cache", "entrypoint": ENTRYPOINTS["distill_cache"]}


def given_base(run: Run | dict[str, Any]) -> dict[str, Any]:
    """The run's base_model Param, shaped like the pretraining stage's result."""
    run = Run.of(run)
    if not run.base_model:
        # pretraining was skipped or paused on request (its task's log says at which step)
        raise NothingToRun("pretraining produced no model (it was paused or skipped: see the "
                           "pretrain task's log) and the run names no base_model.")
    return {"outputs": {"model_dir": run.base_model}, "mlflow_run_id": "",
            "content_hashes": {"model_dir": run.base_model_hash}}


def evaluate_spec(run: Run | dict[str, Any], data: dict[str, Any], pretrained: dict[str, Any] | None,
                  teacher: dict[str, Any], student: dict[str, Any]) -> dict[str, Any]:
    """Score the pretrained model (or the run's base_model), the teacher and the student."""
    run = Run.of(run)
    return evaluate_models_spec(run, data, {"pretrained": pretrained or given_base(run),
                                            "teacher": teacher, "student": student})


def evaluate_models_spec(run: Run | dict[str, Any], data: dict[str, Any],
                         models: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Evaluate the named stage results; the run's `champion` (pinned in start_run) joins them
    when there was one, so the gate compares challengers with it on the same data. Every try of
    the task builds the same spec, whatever happened to the alias since.

    The champion is an input keyed by its content hash (its version's `lineage.content_sha256`),
    not by its version: the same weights evaluated on the same data are the same job (the step
    cache reuses it). A model of this run holding exactly the champion's weights (an identical
    rerun's student, once crowned) is scored once; the gate reads the champion's scores from it
    (promotion.with_champion)."""
    run = Run.of(run)
    # A run from before pinning (started by an older deployment) reads the champion now.
    champion = run.champion if run.champion_pinned else promotion.current_champion(run.model_name)
    contents = {name: r.get("content_sha256", "") for name, r in models.items()}
    if champion and promotion.same_weights(champion, contents) is None:
        models = {**models, promotion.CHAMPION: _champion_result(champion)}
    refs = {name: r["outputs"]["model_dir"] for name, r in models.items()}
    config = {**run.config["evaluate"], "models": refs,
              "data_dir": data["outputs"]["data_dir"], "output_dir": _out(run, "evaluate")}
    lineage = {f"{name}_run_id": r.get("mlflow_run_id") or "" for name, r in models.items()}
    if champion:
        lineage[f"{promotion.CHAMPION}_run_id"] = champion["run_id"] or ""
    inputs = {"data": _data_input(data), **{n: _model_input(r) for n, r in models.items()}}
    return _spec(run, "evaluate", config, data_hash=data["data_hash"], lineage=lineage,
                 inputs=inputs)


def _champion_result(champion: dict[str, Any]) -> dict[str, Any]:
    """A registry version shaped like a stage result: its URI stands for its content in the
    step cache's identity (a version registered without a content hash: the URI itself)."""
    return {"outputs": {"model_dir": champion["uri"]}, "mlflow_run_id": champion["run_id"],
            "content_hashes": {"model_dir": champion.get("content_sha256") or champion["uri"]}}


# -- the gate (plugins/llmops/promotion.py) -------------------------------------------------

gate_decisions = promotion.gate_decisions
LifecycleGateError = promotion.LifecycleGateError


def promote(run: Run | dict[str, Any], evaluation: dict[str, Any], data: dict[str, Any]
            ) -> dict[str, Any]:
    """The gate on teacher and student (and against the current champion, when the evaluation
    scored one): the preferred passing model is registered with its lineage and becomes
    `champion`; otherwise the preferred one is kept as `challenger` with the reasons."""
    return promotion.promote(run, evaluation, data, candidates=("teacher", "student"))
