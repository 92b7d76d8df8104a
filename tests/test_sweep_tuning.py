"""The sweep as one SageMaker hyperparameter tuning job: the request validates against botocore's
service model, moto accepts it, and the trial job applies SageMaker's choice of values."""

from __future__ import annotations

import json

import pytest

from llmops.infra.aws.validation import AwsRequestError
from llmops.stages import lifecycle
from llmops.stages import sweep_tuning as tuning
from tasks import configs

ROLE = "arn:aws:iam::123456789012:role/llmops-sagemaker"
IMAGE = "763104351884.dkr.ecr.us-east-1.amazonaws.com/pytorch-training:2.8.0-gpu-py312"
SETTINGS = {"sagemaker": {"role_arn": ROLE, "staging_uri": "s3://llmops-test/staging",
                          "image": IMAGE, "instance_type": "ml.g5.2xlarge"}}


def gpu_run(**sweep) -> tuple[dict, dict]:
    cfg = lifecycle.resolve({"recipe": "gpu"})
    for key, value in sweep.items():
        setattr(cfg.sweep, key, value)
    cfg = configs.from_dict(configs.LifecycleConfig, configs.to_dict(cfg))
    run = {"dag_id": "llm_lifecycle", "run_id": "manual__2026-02-01T00:00:00+00:00",
           "root": "s3://llmops-test/storage/run", "config": configs.to_dict(cfg),
           "backends": {"sweep": "sagemaker"}, "experiment": "llm_lifecycle", "parent_run_id": ""}
    data = {"outputs": {"data_dir": "s3://llmops-test/data/prepared"}, "data_hash": "f" * 64}
    return run, data


def test_the_sweep_renders_as_a_valid_tuning_job():
    run, data = gpu_run(search_space={"optim.weight_decay": {"low": 0.0, "high": 0.2},
                                      "batch_size": {"choices": [16, 32]},
                                      "optim.warmup_steps": {"low": 10, "high": 100}})
    request = tuning.render(run, data, settings=SETTINGS, max_parallel=4)  # validates
    config, definition = request["HyperParameterTuningJobConfig"], request["TrainingJobDefinition"]
    assert len(request["HyperParameterTuningJobName"]) <= 32
    assert config["Strategy"] == "Bayesian" and config["TrainingJobEarlyStoppingType"] == "Auto"
    assert config["ResourceLimits"] == {"MaxParallelTrainingJobs": 4, "MaxNumberOfTrainingJobs": 8}
    ranges = config["ParameterRanges"]
    assert ranges["ContinuousParameterRanges"] == [
        {"Name": "tune.optim.lr", "MinValue": "0.0001", "MaxValue": "0.003", "ScalingType": "Logarithmic"},
        {"Name": "tune.optim.weight_decay", "MinValue": "0.0", "MaxValue": "0.2", "ScalingType": "Linear"}]
    assert ranges["IntegerParameterRanges"] == [
        {"Name": "tune.optim.warmup_steps", "MinValue": "10", "MaxValue": "100", "ScalingType": "Linear"}]
    assert ranges["CategoricalParameterRanges"] == [{"Name": "tune.batch_size", "Values": ["16", "32"]}]
    # the trials are the sweep's own trial job, as the SageMaker backend renders it
    assert definition["AlgorithmSpecification"]["TrainingImage"] == IMAGE
    assert tuning.OBJECTIVE in definition["AlgorithmSpecification"]["MetricDefinitions"]
    assert json.loads(definition["StaticHyperParameters"]["entrypoint"]) == "tasks.sweep"
    assert not any(k.startswith("tune.") for k in definition["StaticHyperParameters"])
    assert "CheckpointConfig" not in definition, "trials must not resume from each other"
    # nothing syncs a trial's disk: each writes its checkpoints through to a prefix of its own,
    # named by the job entry from the variable SageMaker sets, and links no unsynced dir
    uri = json.loads(definition["StaticHyperParameters"]["checkpoint-uri"])
    assert uri.startswith("s3://") and uri.endswith("/checkpoints/trials/${TRAINING_JOB_NAME}"), uri
    assert "LLMOPS_CHECKPOINT_DIR" not in definition["Environment"]
    assert definition["ResourceConfig"]["InstanceType"] == "ml.g5.2xlarge"


def test_grid_and_asha_map_to_sagemakers_grid_and_hyperband():
    run, data = gpu_run(sampler="grid", trials=3)
    grid = tuning.render(run, data, settings=SETTINGS)["HyperParameterTuningJobConfig"]
    assert grid["Strategy"] == "Grid" and "MaxNumberOfTrainingJobs" not in grid["ResourceLimits"]
    assert grid["ParameterRanges"] == {"CategoricalParameterRanges": [
        {"Name": "tune.optim.lr", "Values": ["0.0001", "0.000548", "0.003"]}]}
    run, data = gpu_run(pruner="asha")
    asha = tuning.render(run, data, settings=SETTINGS)["HyperParameterTuningJobConfig"]
    assert asha["Strategy"] == "Hyperband" and asha["TrainingJobEarlyStoppingType"] == "Off"
    assert asha["StrategyConfig"] == {"HyperbandStrategyConfig": {"MinResource": 1, "MaxResource": 4}}


def test_an_invalid_tuning_request_is_refused_naming_each_field():
    run, data = gpu_run()
    request = tuning.render(run, data, settings=SETTINGS)
    request["HyperParameterTuningJobName"] = "x" * 40                       # max 32
    request["HyperParameterTuningJobConfig"]["ParameterRanges"]["ContinuousParameterRanges"][0][
        "ScalingType"] = "Log"                                              # not in the enum
    with pytest.raises(AwsRequestError) as refused:
        tuning.validate(request)
    message = str(refused.value)
    assert "HyperParameterTuningJobName: 40 characters, more than the maximum 32" in message
    assert "ContinuousParameterRanges[0].ScalingType: 'Log' is not an allowed value" in message
    del request["TrainingJobDefinition"]["RoleArn"]                        # botocore's own check
    with pytest.raises(AwsRequestError, match="Missing required parameter.*RoleArn"):
        tuning.validate(request)


def test_moto_accepts_the_tuning_job_and_reports_it(moto_s3):
    import boto3

    run, data = gpu_run()
    request = tuning.render(run, data, settings=SETTINGS)
    client = boto3.client("sagemaker")
    described = tuning.submit(request, client)
    assert described["HyperParameterTuningJobConfig"]["Strategy"] == "Bayesian"
    assert described["TrainingJobDefinition"]["RoleArn"] == ROLE
    # a retried task submits the same request: it finds that job instead of a second one
    again = tuning.submit(request, client)
    assert again["HyperParameterTuningJobArn"] == described["HyperParameterTuningJobArn"]
    jobs = client.list_hyper_parameter_tuning_jobs()["HyperParameterTuningJobSummaries"]
    assert [j["HyperParameterTuningJobName"] for j in jobs] == [request["HyperParameterTuningJobName"]]


def test_the_trial_job_applies_sagemakers_choice_of_hyperparameters():
    from tasks.sweep import tuned_overrides, with_overrides

    chosen = tuned_overrides({"SM_HPS": json.dumps({"tune.optim.lr": "0.0042",
                                                    "tune.batch_size": "16",
                                                    "entrypoint": "tasks.sweep"})})
    assert chosen == {"optim.lr": "0.0042", "batch_size": "16"}
    cfg = configs.recipe("tiny").pretrain
    cfg.data_dir = cfg.output_dir = "/tmp/x"
    tuned = with_overrides(cfg, chosen)
    assert tuned.optim.lr == 0.0042 and tuned.batch_size == 16 and isinstance(tuned.batch_size, int)
    with pytest.raises(ValueError, match="'optim.lrr' is not a TrainConfig field"):
        with_overrides(cfg, {"optim.lrr": "0.1"})


def test_the_tuning_jobs_best_comes_back_as_config_paths():
    best = tuning.best_of({
        "HyperParameterTuningJobName": "sweep-x", "HyperParameterTuningJobStatus": "Completed",
        "BestTrainingJob": {"TrainingJobName": "sweep-x-003-1a2b3c4d",
                            "TunedHyperParameters": {"tune.optim.lr": "0.0021",
                                                     "tune.batch_size": "16"},
                            "FinalHyperParameterTuningJobObjectiveMetric": {
                                "MetricName": "validation:loss", "Value": 3.25}}})
    assert best == {"params": {"optim.lr": 0.0021, "batch_size": 16}, "lr": 0.0021,
                    "val_loss": 3.25, "training_job": "sweep-x-003-1a2b3c4d"}
    with pytest.raises(ValueError, match="has no completed training job"):
        tuning.best_of({"HyperParameterTuningJobName": "sweep-y",
                        "HyperParameterTuningJobStatus": "InProgress"})
