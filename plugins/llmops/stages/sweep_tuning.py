"""The sweep's search as one SageMaker hyperparameter tuning job (CreateHyperParameterTuningJob).

When the sweep's backend is SageMaker, SageMaker can run the whole search itself: sampling,
parallelism, early stopping. The request is built from what the Airflow sweep uses: the study's
search space and sampler, and the CreateTrainingJob request the SageMaker backend renders for one
trial (image, role, channels, resources, environment), so both run the same job.

    sampler tpe / random / grid -> Strategy Bayesian / Random / Grid (grid: categorical values)
    pruner median               -> TrainingJobEarlyStoppingType Auto (SageMaker's median rule)
    pruner asha                 -> Strategy Hyperband (successive halving; it stops jobs itself)
    search space path P         -> hyperparameter `tune.P`; the trial job applies SageMaker's
                                   choice (SM_HPS) to its config (tasks/sweep.py)
    objective                   -> the loop's `| val_loss X` log line, minimised

Differences from one CreateTrainingJob, on purpose: no CheckpointConfig (the trials would share one
checkpoint prefix and resume from each other); instead each trial writes its checkpoints through
to a prefix of its own, `<checkpoints>/trials/<training job name>` (the entry expands
$TRAINING_JOB_NAME, which SageMaker sets in the container), so a trial SageMaker retries on a new
instance resumes; no warm pool; and the result file is the tuning job's own record
(DescribeHyperParameterTuningJob: BestTrainingJob), not a result.json.

Every request is checked against botocore's service model before it is sent: botocore's own
validation (types, required fields, unknown keys) and llmops.infra.aws.validation (lengths,
patterns, enums), as for every other AWS request of the project.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from llmops.core.run import Run
from llmops.infra.aws.validation import AwsRequestError, service_model, validate_request
from llmops.jobs.backends import remote
from llmops.jobs.backends.backend_settings import load
from llmops.jobs.backends.sagemaker.sagemaker_requests import training_request
from llmops.jobs.backends.sagemaker.sagemaker_settings import SageMakerSettings
from llmops.jobs.spec import JobSpec
from llmops.stages import specs
from llmops.stages.sweep_stage import study_for
from tasks import configs

OPERATION = "CreateHyperParameterTuningJob"
OBJECTIVE = {"Name": "validation:loss", "Regex": r"\| val_loss ([0-9.eE+-]+)"}
STRATEGIES = {"tpe": "Bayesian", "random": "Random", "grid": "Grid"}
TUNED_PREFIX = "tune."  # the job strips it: tasks/sweep.py TUNED_PREFIX
TRIAL_NAME_ENV = "TRAINING_JOB_NAME"   # SageMaker's, in every training container
# CreateTrainingJob fields a training job definition of a tuning job takes as they are.
DEFINITION_FIELDS = ("RoleArn", "InputDataConfig", "OutputDataConfig", "ResourceConfig",
                     "StoppingCondition", "EnableManagedSpotTraining", "VpcConfig", "RetryStrategy",
                     "Environment", "EnableInterContainerTrafficEncryption", "EnableNetworkIsolation")


def tuning_job_name(study_name: str) -> str:
    """At most 32 characters (SageMaker's limit) and the same for the same study: a retried
    task finds the tuning job it created instead of starting a second one."""
    return "sweep-" + hashlib.sha256(study_name.encode()).hexdigest()[:20]


def parameter_ranges(ref: dict[str, Any]) -> dict[str, list]:
    """The study's search space as SageMaker parameter ranges."""
    ranges: dict[str, list] = {"ContinuousParameterRanges": [], "IntegerParameterRanges": [],
                               "CategoricalParameterRanges": []}
    if ref["sampler"] == "grid":  # SageMaker's grid search takes categorical parameters only
        for path, values in ref["grid"].items():
            ranges["CategoricalParameterRanges"].append(
                {"Name": TUNED_PREFIX + path, "Values": [_text(v) for v in values]})
        return {k: v for k, v in ranges.items() if v}
    for path, spec in ref["space"].items():
        name = TUNED_PREFIX + path
        if "choices" in spec:
            ranges["CategoricalParameterRanges"].append(
                {"Name": name, "Values": [_text(v) for v in spec["choices"]]})
            continue
        scaling = "Logarithmic" if spec.get("log") else "Linear"
        if configs.field_type(configs.TrainConfig, path) is int:
            ranges["IntegerParameterRanges"].append(
                {"Name": name, "MinValue": str(int(spec["low"])), "MaxValue": str(int(spec["high"])),
                 "ScalingType": scaling})
        else:
            ranges["ContinuousParameterRanges"].append(
                {"Name": name, "MinValue": repr(float(spec["low"])),
                 "MaxValue": repr(float(spec["high"])), "ScalingType": scaling})
    return {k: v for k, v in ranges.items() if v}


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def tuning_request(training: dict[str, Any], ref: dict[str, Any], *, max_parallel: int) -> dict[str, Any]:
    """CreateHyperParameterTuningJob for the study `ref`, its trials defined by `training`, the
    CreateTrainingJob request the SageMaker backend renders for one trial of the sweep."""
    strategy = STRATEGIES[ref["sampler"]]
    config: dict[str, Any] = {
        "Strategy": strategy,
        "HyperParameterTuningJobObjective": {"Type": "Minimize", "MetricName": OBJECTIVE["Name"]},
        "ResourceLimits": {"MaxParallelTrainingJobs": max(1, min(max_parallel, ref["slots"]))},
        "ParameterRanges": parameter_ranges(ref),
        "TrainingJobEarlyStoppingType": "Auto" if ref["pruner"] == "median" else "Off",
        "RandomSeed": ref["seed"],
    }
    if strategy != "Grid":  # a grid's size is its number of jobs
        config["ResourceLimits"]["MaxNumberOfTrainingJobs"] = ref["slots"]
    if ref["pruner"] == "asha" and strategy != "Grid":
        # Hyperband is SageMaker's successive halving; a resource unit is one reported val_loss
        config["Strategy"] = "Hyperband"
        config["TrainingJobEarlyStoppingType"] = "Off"  # Hyperband stops jobs itself
        config["StrategyConfig"] = {"HyperbandStrategyConfig": {
            "MinResource": 1, "MaxResource": max(1, ref["steps"] // ref["eval_interval"])}}
    tuned = {TUNED_PREFIX + p for p in ref["space"]}
    static = {k: v for k, v in training["HyperParameters"].items()
              if k not in tuned and k != "sagemaker_job_name"}  # each trial gets its own name
    # Nothing syncs a trial's /opt/ml/checkpoints: the entry writes through to the trial's own
    # prefix instead (docker/job_entry.py expands the variable SageMaker sets).
    static["checkpoint-uri"] = json.dumps(
        f"{json.loads(static['checkpoint-uri']).rstrip('/')}/trials/${{{TRIAL_NAME_ENV}}}")
    algorithm = training["AlgorithmSpecification"]
    metrics = [m for m in algorithm.get("MetricDefinitions", []) if m["Name"] != OBJECTIVE["Name"]]
    definition: dict[str, Any] = {
        "StaticHyperParameters": static,
        "AlgorithmSpecification": {"TrainingImage": algorithm["TrainingImage"],
                                   "TrainingInputMode": algorithm["TrainingInputMode"],
                                   "MetricDefinitions": [*metrics, OBJECTIVE]},
        **{k: training[k] for k in DEFINITION_FIELDS if k in training},
    }
    definition["ResourceConfig"] = {k: v for k, v in definition["ResourceConfig"].items()
                                    if k != "KeepAlivePeriodInSeconds"}
    definition["Environment"] = {k: v for k, v in definition.get("Environment", {}).items()
                                 if k != "LLMOPS_CHECKPOINT_DIR"}   # no synced dir to link
    request = {"HyperParameterTuningJobName": tuning_job_name(ref["name"]),
               "HyperParameterTuningJobConfig": config, "TrainingJobDefinition": definition}
    if training.get("Tags"):
        request["Tags"] = training["Tags"]
    return request


def validate(request: dict[str, Any]) -> None:
    """botocore's own checks, then every constraint of the service model it skips (max lengths,
    patterns, enums). Raises with each problem's path."""
    from botocore.validate import ParamValidator

    shape = service_model("sagemaker").operation_model(OPERATION).input_shape
    report = ParamValidator().validate(request, shape)
    if report.has_errors():
        raise AwsRequestError(f"sagemaker.{OPERATION}", report.generate_report().splitlines())
    validate_request("sagemaker", OPERATION, request)


def render(run: Run | dict[str, Any], data: dict[str, Any], *, settings: dict[str, Any] | None = None,
           region: str = "", max_parallel: int = 2) -> dict[str, Any]:
    """The validated tuning request for the run's sweep: one trial's spec rendered by the
    SageMaker backend, turned into the tuning job's training job definition."""
    run = Run.of(run)
    ref = study_for(run)
    middle = {path: (spec["choices"][0] if "choices" in spec else spec["low"])
              for path, spec in ref["space"].items()}  # replaced by SageMaker's choice per job
    spec = JobSpec.from_dict(specs.trial_spec(run, data, ref, 0, {"number": 0, "params": middle}))
    name = tuning_job_name(ref["name"])
    spec = spec.replace(name=name, env={k: v for k, v in spec.env.items()
                                        if not k.startswith("LLMOPS_STUDY")})
    sm = load("sagemaker", SageMakerSettings, settings).for_job(spec)  # the team's role
    sm.require("role_arn", "staging_uri", backend="sagemaker")
    staged = remote.plan(spec, name, sm.staging_uri)
    training, _ = training_request(spec, sm, staged, name, region)
    request = tuning_request(training, ref, max_parallel=max_parallel)
    validate(request)
    return request


def submit(request: dict[str, Any], client: Any) -> dict[str, Any]:
    """Create the tuning job unless it exists (its name is the study's: a retry finds it);
    returns its description. `client` is a boto3 SageMaker client (SageMakerHook.get_conn())."""
    from botocore.exceptions import ClientError

    validate(request)
    name = request["HyperParameterTuningJobName"]
    try:
        return client.describe_hyper_parameter_tuning_job(HyperParameterTuningJobName=name)
    except ClientError as exc:
        if exc.response["Error"]["Code"] not in ("ValidationException", "ResourceNotFound"):
            raise
    client.create_hyper_parameter_tuning_job(**request)
    return client.describe_hyper_parameter_tuning_job(HyperParameterTuningJobName=name)


def best_of(description: dict[str, Any]) -> dict[str, Any]:
    """The best training job of a DescribeHyperParameterTuningJob answer, as the sweep reports
    its best trial (config paths, not `tune.` names)."""
    best = description.get("BestTrainingJob") or {}
    if not best:
        raise ValueError(f"Tuning job {description.get('HyperParameterTuningJobName')} has no "
                         f"completed training job ({description.get('HyperParameterTuningJobStatus')}).")
    params = {k[len(TUNED_PREFIX):]: _number(v) for k, v in best["TunedHyperParameters"].items()
              if k.startswith(TUNED_PREFIX)}
    return {"params": params, "lr": params.get("optim.lr"),
            "val_loss": best["FinalHyperParameterTuningJobObjectiveMetric"]["Value"],
            "training_job": best["TrainingJobName"]}


def _number(text: str) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text
