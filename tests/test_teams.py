"""Teams in their lanes (plugins/llmops/policy/teams.py) and a budget on every job
(plugins/llmops/policy/budget.py `run_estimate`, teams.check_team): each allowlist rule of the
`llmops_teams` Variable refuses a run in start_run with the field, the team, the rule and the fix,
before any job and before the MLflow parent run; the backends submit with the team's role, fair
share, namespace and queue; a run over the team's monthly budget, counting the ledger's spend, is
refused. start_run is called directly (no DAG run); the `refused` fixture asserts that no job
directory and no MLflow run exist afterwards.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import json

import pytest

from llmops.jobs.backends import backend_settings
from llmops.jobs.backends.batch.batch_settings import BatchSettings
from llmops.jobs.backends.hyperpod.hyperpod_settings import HyperPodSettings
from llmops.jobs.backends.sagemaker.sagemaker_settings import SageMakerSettings
from llmops.jobs.spec import JobSpec
from llmops.policy import budget, teams
from llmops.stages import lifecycle, specs
from tests.aws_fixtures import IMAGE, ROLE, sagemaker_settings
from tests.test_start_run_validation import DAG_ID, mlflow_runs, refused, snapshot  # noqa: F401 (a fixture)

NLP_ROLE = "arn:aws:iam::123456789012:role/llmops-nlp"
NLP_IMAGES = "123456789012.dkr.ecr.us-east-1.amazonaws.com/nlp/"
VISION_IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/vision/train:1"


def config(tmp_path, **nlp) -> dict:
    for name in ("nlp-out", "nlp-data", "vision-out", "vision-data"):
        (tmp_path / name).mkdir(exist_ok=True)
    return {"default_team": "nlp", "teams": {
        "nlp": {"role_arn": NLP_ROLE, "image_prefixes": [NLP_IMAGES],
                "storage_prefixes": [str(tmp_path / "nlp-out"), "s3://llmops-validation/nlp/"],
                "data_prefixes": ["s3://corpora/nlp/"],
                "local_data_roots": [str(tmp_path / "nlp-data")],
                "batch_share_identifier": "nlpshare", "hyperpod_namespace": "hyperpod-ns-nlp",
                "hyperpod_queue": "hyperpod-ns-nlp-localqueue", "priority": {"min": 0, "max": 500},
                "members": ["alice"], **nlp},
        "vision": {"role_arn": "arn:aws:iam::123456789012:role/llmops-vision",
                   "image_prefixes": ["123456789012.dkr.ecr.us-east-1.amazonaws.com/vision/"],
                   "storage_prefixes": [str(tmp_path / "vision-out")],
                   "local_data_roots": [str(tmp_path / "vision-data")],
                   "batch_share_identifier": "visionshare",
                   "hyperpod_namespace": "hyperpod-ns-vision",
                   "hyperpod_queue": "hyperpod-ns-vision-localqueue"}}}


@pytest.fixture()
def team_setup(tmp_path, monkeypatch):
    """Two teams; SageMaker settings whose default image is nlp's; a local state directory (and
    so a job ledger) of the test's own."""
    monkeypatch.setenv("LLMOPS_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("AIRFLOW_VAR_LLMOPS_TEAMS", json.dumps(config(tmp_path)))
    monkeypatch.setenv("AIRFLOW_VAR_LLMOPS_BACKENDS", json.dumps(
        {"sagemaker": sagemaker_settings("llmops-validation", image=NLP_IMAGES + "train:1")}))
    return tmp_path


@pytest.fixture()
def team_refused(team_setup, refused):
    """`refused` (no job directory, no MLflow run afterwards), in team_setup's state directory."""
    return refused


def nlp_run(tmp_path, **params) -> dict:
    return {"storage_root": str(tmp_path / "nlp-out"), **params}


# -- each allowlist rule --------------------------------------------------------------------------

def test_a_team_that_is_not_configured_is_refused(team_refused, team_setup):
    team_refused(nlp_run(team_setup, team="cv"),
            r"Param 'team' = 'cv' is not a team configured in the Airflow Variable 'llmops_teams' "
            r"\(teams: nlp, vision\)", r"leave it empty for the default team 'nlp'")


def test_a_user_who_is_not_a_member_of_the_team_is_refused(team_setup):
    jobs, runs = snapshot(), len(mlflow_runs())
    with pytest.raises(teams.TeamError, match=r"Param 'team' = 'nlp': user 'mallory' is not one of "
                                              r"team nlp's members \(llmops_teams\.teams\.nlp\."
                                              r"members\)\. Run as your own team"):
        lifecycle.start_run({"recipe": "tiny", **nlp_run(team_setup)}, dag_id=DAG_ID,
                            run_id="manual__mallory", user="mallory")
    assert (snapshot(), len(mlflow_runs())) == (jobs, runs), "a refused run left a job or an MLflow run"
    run = lifecycle.start_run({"recipe": "tiny", **nlp_run(team_setup)}, dag_id=DAG_ID,
                              run_id="manual__alice", user="alice")
    assert run["team"] == "nlp"


def test_a_priority_outside_the_teams_range_is_refused(team_refused, team_setup):
    team_refused(nlp_run(team_setup, priority=900),
            r"Param 'priority' = 900 is outside team nlp's priority range 0-500 "
            r"\(llmops_teams\.teams\.nlp\.priority\)", r"Give a priority from 0 to 500")


def test_a_storage_root_of_another_team_is_refused(team_refused, team_setup):
    team_refused({"storage_root": str(team_setup / "vision-out")},
            r"Param 'storage_root' '.*/vision-out' is not under team nlp's storage_prefixes "
            r"\[.*nlp-out.*\] \(llmops_teams\.teams\.nlp\.storage_prefixes\)",
            r"Set storage_root to a path under one of them")


def test_the_default_storage_root_outside_the_teams_prefixes_is_refused(team_refused, team_setup):
    team_refused({}, r"The default storage root \(Param 'storage_root' is empty\) .* is not under team "
                r"nlp's storage_prefixes")


def test_a_local_data_input_outside_the_teams_local_data_roots_is_refused(team_refused, team_setup):
    corpus = team_setup / "vision-data" / "corpus.jsonl"
    corpus.write_text('{"id": "1", "text": "hello"}\n')
    team_refused(nlp_run(team_setup, data_inputs=[str(corpus)]),
            r"Param 'data_inputs' entry '.*vision-data/corpus\.jsonl' is not under team nlp's "
            r"local_data_roots", r"llmops_teams\.teams\.nlp\.local_data_roots")


def test_a_symlink_out_of_the_teams_data_root_is_refused(team_refused, team_setup):
    target = team_setup / "vision-data" / "secret.jsonl"
    target.write_text('{"id": "1", "text": "vision only"}\n')
    (team_setup / "nlp-data" / "a.jsonl").symlink_to(target)
    team_refused(nlp_run(team_setup, data_inputs=[str(team_setup / "nlp-data" / "*.jsonl")]),
            r"local_data_roots", r"nlp-data/a\.jsonl resolves outside them")


def test_an_s3_data_input_outside_the_teams_data_prefixes_is_refused(team_refused, team_setup, monkeypatch):
    # the deployment allows both buckets; the team only its own prefix
    monkeypatch.setenv("LLMOPS_ALLOWED_DATA_ROOTS", "s3://corpora/")
    team_refused(nlp_run(team_setup, data_inputs=["s3://corpora/vision/part-0.jsonl"]),
            r"Param 'data_inputs' entry 's3://corpora/vision/part-0\.jsonl' is not under team "
            r"nlp's data_prefixes \['s3://corpora/nlp/'\]")


def test_an_image_outside_the_teams_image_prefixes_is_refused(team_refused, team_setup):
    team_refused(nlp_run(team_setup, backend_pretrain="sagemaker",
                    stage_resources={"pretrain": {"image": VISION_IMAGE}}),
            rf"The pretrain stage's image \(stage_resources\.pretrain\.image\) '{VISION_IMAGE}' is "
            rf"not under team nlp's image_prefixes \['{NLP_IMAGES}'\]", r"Use an image from one of them")


def test_the_backend_settings_default_image_is_checked_too(team_refused, team_setup, monkeypatch):
    monkeypatch.setenv("AIRFLOW_VAR_LLMOPS_BACKENDS",
                       json.dumps({"sagemaker": sagemaker_settings("llmops-validation")}))
    team_refused(nlp_run(team_setup, backend_finetune="sagemaker"),
            r"The finetune stage's image \(the sagemaker settings' image in the Variable "
            r"llmops_backends\) '763104351884\.dkr\.ecr.*' is not under team nlp's image_prefixes")


def test_a_run_inside_its_teams_lane_starts(team_setup):
    """The control: the same checks let a run inside its team's lane through (default team)."""
    corpus = team_setup / "nlp-data" / "corpus.jsonl"
    corpus.write_text('{"id": "1", "text": "hello"}\n')
    run = lifecycle.start_run(nlp_run(team_setup, recipe="tiny", priority=500,
                                      data_inputs=[str(corpus)]),
                              dag_id=DAG_ID, run_id="manual__team_ok")
    assert run["team"] == "nlp"   # empty team = the default team, on every job's tags
    assert specs.data_prep_spec(run)["tags"]["team"] == "nlp"


def test_without_the_variable_the_team_stays_a_free_label(monkeypatch, tmp_path):
    monkeypatch.delenv("AIRFLOW_VAR_LLMOPS_TEAMS", raising=False)
    run = lifecycle.start_run({"recipe": "tiny", "team": "anyone"}, dag_id=DAG_ID,
                              run_id="manual__no_teams")
    assert run["team"] == "anyone"


# -- the backends take the team's role, share, namespace and queue ------------------------------

def spec_of(team: str, stage: str = "pretrain") -> JobSpec:
    """A job as the run's spec builders make it: the team's settings travel on the spec."""
    return JobSpec(stage=stage, entrypoint="tasks.pretrain", name="job-1", backend="sagemaker",
                   image=NLP_IMAGES + "train:1", instance_type="ml.g5.2xlarge",
                   output_uri="s3://llmops-validation/nlp/out", tags={"team": team},
                   settings_overrides=teams.settings_overrides(team))


def test_jobs_run_with_their_teams_role_share_namespace_and_queue(team_setup):
    from llmops.jobs.backends import remote
    from llmops.jobs.backends.batch import batch_requests as batch
    from llmops.jobs.backends.sagemaker import sagemaker_requests as sagemaker

    deployment = {"sagemaker": sagemaker_settings("llmops-validation"),
                  "batch": {"job_queue": "q", "staging_uri": "s3://llmops-validation/staging",
                            "job_role_arn": ROLE},
                  # a fixed namespace and queue: the team's replace them
                  "hyperpod": {"namespace": "shared", "queue_name": "shared-queue",
                               "stages": {"pretrain": {"namespace": "pretrain-ns"}}}}
    for team, role, share, namespace in (
            ("nlp", NLP_ROLE, "nlpshare", "hyperpod-ns-nlp"),
            ("vision", "arn:aws:iam::123456789012:role/llmops-vision", "visionshare",
             "hyperpod-ns-vision")):
        spec = spec_of(team)
        sm = backend_settings.load("sagemaker", SageMakerSettings, deployment).for_job(spec)
        request, _ = sagemaker.training_request(spec, sm, remote.plan(spec, "job-1-a1", sm.staging_uri),
                                                "job-1-a1")
        assert request["RoleArn"] == role
        b = backend_settings.load("batch", BatchSettings, deployment).for_job(spec)
        assert b.job_role_arn == role
        assert batch.scheduling(spec, b.share_identifier)["shareIdentifier"] == share
        hp = backend_settings.load("hyperpod", HyperPodSettings, deployment).for_job(spec)
        assert (hp.namespace, hp.queue_name) == (namespace, f"{namespace}-localqueue")
    # a job tagged with no team gets the default team's; one tagged with a removed team is refused
    assert backend_settings.load("batch", BatchSettings, deployment) \
        .for_job(spec_of("")).share_identifier == "nlpshare"
    with pytest.raises(teams.TeamError, match=r"Param 'team' = 'cv' is not a team configured"):
        backend_settings.load("hyperpod", HyperPodSettings, deployment).for_job(spec_of("cv"))


def test_without_teams_the_backend_settings_are_unchanged(monkeypatch):
    monkeypatch.delenv("AIRFLOW_VAR_LLMOPS_TEAMS", raising=False)
    deployment = {"hyperpod": {"namespace": "hyperpod-ns-{team}"}, "batch": {"job_queue": "q"}}
    spec = spec_of("nlp")
    hp = backend_settings.load("hyperpod", HyperPodSettings, deployment).for_job(spec)
    assert hp.namespace == "hyperpod-ns-{team}"
    from llmops.jobs.backends.batch import batch_requests as batch

    b = backend_settings.load("batch", BatchSettings, deployment).for_job(spec)
    assert batch.scheduling(spec, b.share_identifier)["shareIdentifier"] == "nlp"


# -- the Variable's own validation ----------------------------------------------------------------

@pytest.mark.parametrize("change, pattern", [
    ({"teams": {"nlp": {"role_arn": NLP_ROLE, "image_prefix": ["x/"]}}},
     r"Unknown key\(s\) \['image_prefix'\] for team 'nlp' in the Airflow Variable 'llmops_teams'"),
    ({"teams": {"nlp": {"role_arn": "arn:aws:iam::12345:user/bob"}}},
     r"llmops_teams\.teams\.nlp\.role_arn 'arn:aws:iam::12345:user/bob' is not an IAM role ARN"),
    ({"teams": {"nlp": {"storage_prefixes": ["s3://Bad_Bucket/x"]}}},
     r"llmops_teams\.teams\.nlp\.storage_prefixes entry 's3://Bad_Bucket/x' is not a valid s3://"),
    ({"teams": {"nlp": {"data_prefixes": ["/data"]}}},
     r"data_prefixes entry '/data' must be an s3://bucket/prefix"),
    ({"teams": {"nlp": {"image_prefixes": ["123456789012.dkr.ecr.us-east-1.amazonaws.com"]}}},
     r"image_prefixes entry .* must name a registry and a repository path and end with '/'"),
    ({"teams": {"nlp": {"priority": {"min": 10, "max": 5}}}}, r"0 <= min <= max <= 9999"),
    ({"teams": {"nlp": {"priority": {"lo": 1}}}}, r"priority must be an object with keys min and max"),
    ({"teams": {"nlp": {"accelerator_hours_budget": "lots"}}}, r"accelerator_hours_budget must be a number"),
    ({"teams": {"nlp": {"hyperpod_namespace": "NLP_ns"}}}, r"must be a Kubernetes name"),
    ({"teams": {"NLP": {}}}, r"team name 'NLP' must be a lowercase letter"),
    ({"teams": {"nlp": {"hyperpod_queue": "q"}, "vision": {"hyperpod_queue": "q"}}},
     r"teams nlp and vision both have hyperpod_queue 'q'"),
    ({"teams": {"nlp": {}}, "default_team": "vision"}, r"default_team 'vision' is not one of its teams"),
    ({"teams": {}, "budgets": {}}, r"Unknown key\(s\) \['budgets'\] in the Airflow Variable 'llmops_teams'"),
])
def test_the_variable_is_validated_on_load(change, pattern):
    with pytest.raises(teams.TeamError, match=pattern):
        teams.parse(change)


def test_a_broken_variable_refuses_the_run_before_any_job(refused, monkeypatch):
    monkeypatch.setenv("AIRFLOW_VAR_LLMOPS_TEAMS", json.dumps({"teams": {"nlp": {"rolearn": "x"}}}))
    refused({}, r"Unknown key\(s\) \['rolearn'\] for team 'nlp'")


# -- budgets on every job ---------------------------------------------------------------------------
# The spend and the accelerators per instance come from the job ledger
# (plugins/llmops/infra/ledger/, its price table): without it installed these have nothing to read.
needs_ledger = pytest.mark.skipif(importlib.util.find_spec("llmops.infra.ledger") is None,
                                  reason="the job ledger (llmops.infra.ledger) is not installed")

def record_spend(team: str, instance_type: str, hours: float, ended: dt.datetime) -> None:
    """An attempt that ran `hours` and ended at `ended`, recorded in the job ledger as the
    JobOperator records it (its accelerator-hours from the ledger's price table)."""
    from llmops.infra import ledger
    from llmops.infra.ledger.events import JobEvent

    end = ended.timestamp()
    assert ledger.record(JobEvent(event="ended", job_name=f"{team}-{end}", team=team,
                                  stage="pretrain", backend="sagemaker", instance_type=instance_type,
                                  submitted_at=end - hours * 3600, started_at=end - hours * 3600,
                                  ended_at=end, state="succeeded"))


P5 = {"instance_type": "ml.p5.48xlarge", "instance_count": 2, "max_run_seconds": 3600}


@needs_ledger
def test_a_run_over_the_teams_remaining_budget_is_refused_from_the_ledgers_spend(team_refused, team_setup,
                                                                                  monkeypatch):
    monkeypatch.setenv("AIRFLOW_VAR_LLMOPS_TEAMS",
                       json.dumps(config(team_setup, accelerator_hours_budget=10)))
    now = dt.datetime.now(dt.timezone.utc)
    record_spend("nlp", "ml.g5.2xlarge", 9.5, now)                  # 1 GPU x 9.5 h this month
    record_spend("nlp", "ml.p5.48xlarge", 50, teams.period_start() - dt.timedelta(hours=1))
    record_spend("vision", "ml.p5.48xlarge", 50, now)              # another team's spend
    assert teams.spend_hours("nlp", teams.period_start()) == pytest.approx(9.5)
    params = nlp_run(team_setup, backend_pretrain="sagemaker", stage_resources={"pretrain": P5})
    message = team_refused(params,
                      r"Team nlp's runs have 10 accelerator-hours a month \(llmops_teams\.teams\.nlp\."
                      r"accelerator_hours_budget\); the job ledger records 9\.5 spent since "
                      rf"{teams.period_start():%Y-%m-%d}, so 0\.5 remain",
                      r"pretrain on sagemaker: 2 x ml\.p5\.48xlarge \(8 accelerators per instance\), "
                      r"training FLOPs \+ start-up 1\.33\d* \(max run 1 h, at most 16\)",
                      r"data_prep on local: 0", r"Lower stage_resources\.pretrain\.instance_count")
    assert "at most 16) = 1.33" in message
    # with last month's and the other team's spend only, the same run fits
    estimate = budget.run_estimate(lifecycle.resolve({"recipe": "tiny"}),
                                   {s: params.get(f"backend_{s}") or "local" for s in
                                    ("data_prep", "sweep", "pretrain", "finetune", "distill", "evaluate")},
                                   params)
    assert 1.3 < sum(e.hours for e in estimate) < 1.4


@needs_ledger
def test_a_thousand_instance_pretraining_job_is_refused_by_a_small_budget(team_refused, team_setup,
                                                                         monkeypatch):
    monkeypatch.setenv("AIRFLOW_VAR_LLMOPS_TEAMS",
                       json.dumps(config(team_setup, accelerator_hours_budget=100)))
    team_refused(nlp_run(team_setup, backend_pretrain="sagemaker",
                    stage_resources={"pretrain": {**P5, "instance_count": 1000, "max_run_seconds": 86400}}),
            r"the job ledger records 0 spent", r"this run is estimated at 66\d\.\d",
            r"pretrain on sagemaker: 1000 x ml\.p5\.48xlarge \(8 accelerators per instance\)")


@needs_ledger
def test_every_stage_on_every_backend_has_an_estimate(team_setup, monkeypatch):
    monkeypatch.setenv("AIRFLOW_VAR_LLMOPS_BACKENDS", json.dumps({
        "sagemaker": sagemaker_settings("b"), "sagemaker_processing": sagemaker_settings("b"),
        "batch": {"job_queue": "q", "instance_type": "p4d.24xlarge", "gpus": 8},
        "hyperpod": {"instance_type": "ml.p5.48xlarge", "instance_count": 4}}))
    cfg = lifecycle.resolve({"recipe": "tiny"})
    backends = {"data_prep": "sagemaker_processing", "sweep": "batch", "pretrain": "hyperpod",
                "finetune": "sagemaker", "distill": "local", "evaluate": "batch"}
    params = {"stage_resources": {"data_prep": {"instance_type": "ml.m5.xlarge", "instance_count": 3},
                                  "evaluate": {"max_run_seconds": 7200}}}
    by_stage = {e.stage: e for e in budget.run_estimate(cfg, backends, params)}
    assert set(by_stage) == set(backends)
    assert by_stage["data_prep"].hours == 0          # CPU instances: no accelerators
    assert by_stage["distill"].hours == 0            # the worker's CPU
    assert by_stage["evaluate"].flops_hours is None  # not a training stage: the upper bound
    assert by_stage["evaluate"].hours == 8 * 2       # 1 x p4d (8 GPUs, Batch `gpus`) x 2 h
    assert by_stage["pretrain"].upper_hours == 4 * 8 * 24
    assert by_stage["sweep"].jobs > 1 and by_stage["sweep"].hours > by_stage["finetune"].hours > 0


def test_the_scaling_ladder_runs_in_the_default_teams_lane(team_setup):
    """start_ladder shares the checks (lifecycle.check_lane): the ladder DAG has no team Param, so
    its runs are the default team's, and its storage root must be under nlp's prefixes."""
    from llmops.stages import ladder_stage as ladder

    runs = len(mlflow_runs())
    with pytest.raises(teams.TeamError, match=r"Param 'storage_root' '.*/vision-out' is not under "
                                              r"team nlp's storage_prefixes"):
        ladder.start_ladder({"recipe": "tiny", "storage_root": str(team_setup / "vision-out")},
                            dag_id=DAG_ID, run_id="manual__ladder_vision")
    with pytest.raises(lifecycle.LifecycleParamError, match=r"outside the allowed storage roots"):
        ladder.start_ladder({"recipe": "tiny", "storage_root": "/etc"}, dag_id=DAG_ID,
                            run_id="manual__ladder_etc")
    assert len(mlflow_runs()) == runs, "a refused ladder opened an MLflow run"
