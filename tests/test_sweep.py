"""Sweeps: the Optuna study's slots, real trial jobs reporting to it and being pruned, and the
budget refusal. (The sweep under Airflow: tests/test_sweep_dag.py.)"""

from __future__ import annotations

import pytest

from llmops.policy import budget
from llmops.policy import sweep_study as studies
from llmops.stages import sweep_stage as stage
from tasks import configs
from tasks.configs import OptimConfig, TrainConfig, from_dict, tiny, to_dict


def ref_for(tmp_path, **sweep) -> dict:
    cfg = to_dict(configs.SweepConfig(**{"trials": 3, "steps": 40, "evals": 4, **sweep}))
    return studies.study_ref(dag_id="test", run_id=f"run-{tmp_path.name}", sweep=cfg,
                             storage=f"sqlite:///{tmp_path}/optuna.db")


def test_a_slot_keeps_its_trial_across_retries_and_a_failed_one_is_replaced(tmp_path):
    ref = ref_for(tmp_path)
    study = studies.open_study(ref, create=True)
    first = studies.trial_for_slot(study, ref, 0)
    other = studies.trial_for_slot(study, ref, 1)
    assert first.number != other.number
    assert first.params != other.params, "each slot draws its own point, even from a fresh process"
    assert 1e-3 <= first.params["optim.lr"] <= 1e-2

    # a retry (or a rerun of the DAG run) opens the study again and finds the same trial
    again = studies.trial_for_slot(studies.open_study(ref, create=True), ref, 0)
    assert (again.number, again.params) == (first.number, first.params)

    studies.record(study, first.number, {"state": "complete", "metrics": {"val_loss": 4.2}})
    kept = studies.trial_for_slot(studies.open_study(ref), ref, 0)
    assert kept.state.name == "COMPLETE" and kept.value == 4.2
    assert kept.user_attrs["result"]["metrics"]["val_loss"] == 4.2

    # a trial that failed for good is replaced by a new one when its slot runs again
    studies.fail(study, other.number, "the job exited with code 1")
    replacement = studies.trial_for_slot(studies.open_study(ref), ref, 1)
    assert replacement.number not in (first.number, other.number)
    assert replacement.user_attrs["replaces"] == other.number

    # whatever still runs once every slot's task is done lost its task: marked failed
    assert studies.fail_orphans(study) == [replacement.number]


def test_processes_opening_a_new_study_store_at_once_all_get_it(tmp_path):
    """Optuna creates a store's tables on first open; opened at once (two sweeps planned on a new
    store, a reader during the first plan) all but one failed in every round without the retry."""
    import threading

    for round_ in range(5):
        url = f"sqlite:///{tmp_path / f'store-{round_}' / 'optuna.db'}"
        start, errors, opened = threading.Barrier(4), [], []

        def open_it() -> None:
            start.wait()
            try:
                opened.append(studies.open_storage(url))
            except Exception as exc:  # noqa: BLE001 - collected for the assert
                errors.append(repr(exc)[:200])

        threads = [threading.Thread(target=open_it) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [] and len(opened) == 4


def test_grid_sampler_covers_learning_rates_times_choices(tmp_path):
    ref = ref_for(tmp_path, sampler="grid", trials=2,
                  search_space={"batch_size": {"choices": [4, 8]}})
    assert ref["slots"] == 4 and ref["grid"] == {"optim.lr": [1e-3, 1e-2], "batch_size": [4, 8]}
    study = studies.open_study(ref, create=True)
    seen = {(t.params["optim.lr"], t.params["batch_size"])
            for t in (studies.trial_for_slot(study, ref, s) for s in range(ref["slots"]))}
    assert seen == {(1e-3, 4), (1e-3, 8), (1e-2, 4), (1e-2, 8)}


def test_search_space_mistakes_are_refused_naming_the_field():
    with pytest.raises(configs.ConfigError, match=r"search_space\['optim.wd'\]: not a number"):
        configs.SweepConfig(search_space={"optim.wd": {"low": 0, "high": 1}})
    with pytest.raises(configs.ConfigError, match="sampler 'grid' needs"):
        configs.SweepConfig(sampler="grid", search_space={"optim.weight_decay": {"low": 0, "high": 1}})


# --------------------------------------------------------------------------------------------
# Real trial jobs (tasks/sweep.py, in this process) reporting to the study


def run_trial_job(ref, study, slot, data_dir, tmp_path, monkeypatch, lr=None) -> dict:
    """What TrialOperator and the local backend do for a slot, minus Airflow: ask the study,
    run `tasks.sweep.main` with the trial's env, tell the study the outcome."""
    from tasks.sweep import main

    trial = studies.trial_for_slot(study, ref, slot)
    cfg = tiny().pretrain
    cfg.data_dir, cfg.output_dir = str(data_dir), str(tmp_path / f"trial-{trial.number}")
    every = ref["eval_interval"]
    cfg = from_dict(TrainConfig, {**to_dict(cfg), "max_steps": ref["steps"], "eval_interval": every,
                                  "checkpoint_interval": ref["steps"], "log_interval": every,
                                  "optim": {**to_dict(OptimConfig()), "warmup_steps": 4,
                                            "lr": lr or trial.params["optim.lr"]}})
    for name, value in studies.job_env(ref, trial.number, "local").items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    result = main(cfg)
    assert studies.record(study, trial.number, result) == result["state"]
    return result


@pytest.mark.parametrize("pruner", ["median", "asha"])
def test_pruning_stops_a_hopeless_trial_at_its_first_evaluation(pruner, tiny_data_dir, tmp_path,
                                                               monkeypatch):
    import mlflow

    # The median pruner waits for two finished trials. ASHA promotes, at each rung, only the
    # best of the first eta - 1 = 2 trials there, so a second good trial a hair worse than the
    # first at step 30 is rightly stopped (which one is worse depends on the sampled rates): one
    # good trial before the hopeless one.
    good_slots = (0, 1) if pruner == "median" else (0,)
    ref = ref_for(tmp_path, pruner=pruner, trials=len(good_slots) + 1, steps=40, evals=4,
                  lr_min=3e-3, lr_max=1e-2)
    study = studies.open_study(ref, create=True)
    good = [run_trial_job(ref, study, slot, tiny_data_dir, tmp_path, monkeypatch)
            for slot in good_slots]
    # a learning rate 1000x too small: the loss stays near ln(vocab) while the others fall
    hopeless = run_trial_job(ref, study, len(good_slots), tiny_data_dir, tmp_path, monkeypatch,
                             lr=1e-6)

    assert [g["state"] for g in good] == ["complete"] * len(good_slots)
    assert [g["metrics"]["step"] for g in good] == [40] * len(good_slots)
    assert hopeless["state"] == "pruned"
    assert hopeless["metrics"]["step"] == ref["eval_interval"] == 10, "stopped at the first eval"
    assert hopeless["metrics"]["val_loss"] > max(g["metrics"]["val_loss"] for g in good)
    states = [t["state"] for t in studies.summary(study)]
    assert states == ["complete"] * len(good_slots) + ["pruned"]

    # the trial's MLflow run shows the short curve and says it was pruned
    client = mlflow.MlflowClient()
    pruned_run = client.get_run(hopeless["mlflow_run_id"])
    assert pruned_run.data.tags["trial_state"] == "pruned"
    assert [m.step for m in client.get_metric_history(hopeless["mlflow_run_id"], "loss/val")] == [10]
    assert len(client.get_metric_history(good[0]["mlflow_run_id"], "loss/val")) == 4
    assert pruned_run.data.metrics["trial/steps_saved"] == 30


# --------------------------------------------------------------------------------------------
# Budget


def test_a_sweep_over_budget_is_refused_with_the_estimate_and_the_budget():
    cfg = tiny()
    cfg.sweep.budget_hours = 0.001
    with pytest.raises(budget.BudgetError) as refused:
        budget.check_sweep(cfg, "local")
    message = str(refused.value)
    estimate = budget.sweep_estimate(cfg, "local")
    assert f"an estimated {estimate.hours:.3g} accelerator-hours" in message
    assert "more than this run's budget of 0.001 (budget_hours)" in message
    assert "2 trials x 10 steps" in message and "Nothing was started." in message
    cfg.sweep.budget_hours = 1.0
    assert budget.check_sweep(cfg, "local").hours < 1.0


def test_a_lifecycle_run_over_its_sweep_budget_fails_in_start_run():
    """What the DAG's first task calls: it raises before the MLflow parent run or any job."""
    from llmops.infra import tracking
    from llmops.policy import budget
    from llmops.stages import lifecycle

    with pytest.raises(budget.BudgetError, match=r"The sweep would use an estimated .* more than "
                                                 r"this run's budget of 1e-06 \(budget_hours\)"):
        lifecycle.start_run({"recipe": "tiny", "budget_hours": 1e-6}, dag_id="llm_lifecycle",
                            run_id="sweep-over-budget")
    exp = tracking.client().get_experiment_by_name("llm_lifecycle")
    assert exp is None or not tracking.client().search_runs(
        [exp.experiment_id], "tags.run_id = 'sweep-over-budget'"), "no MLflow run was opened"


def test_remote_estimates_use_the_instance_types_accelerator(monkeypatch):
    cfg = configs.recipe("gpu")
    monkeypatch.setenv("AIRFLOW_VAR_LLMOPS_BACKENDS",
                       '{"sagemaker": {"instance_type": "ml.g5.2xlarge", '
                       '"stages": {"sweep": {"instance_type": "ml.p5.48xlarge"}}}}')
    assert budget.instance_type_for("sagemaker", "sweep") == "ml.p5.48xlarge"
    assert budget.instance_type_for("sagemaker", "ladder") == "ml.g5.2xlarge"
    on_p5 = budget.sweep_estimate(cfg, "ml.p5.48xlarge")
    on_g5 = budget.sweep_estimate(cfg, "ml.g5.2xlarge")
    assert on_p5.accelerator == "H100 SXM" and on_g5.accelerator == "A10G"
    assert on_p5.flops == on_g5.flops and on_p5.hours < on_g5.hours
    # 8 trials x (300 steps x 32 x 1024 tokens, 6 FLOPs per parameter and token; 4 evals of 8
    # batches, 2 FLOPs) of a 91.2M-parameter model
    params, tokens = 91_226_112, 32 * 1024
    assert on_g5.flops == pytest.approx(8 * (6 * params * 300 * tokens + 2 * params * 4 * 8 * tokens))
    assert on_g5.hours == pytest.approx(on_g5.flops / (0.4 * 125e12) / 3600 + 8 * 300 / 3600)


def test_apply_best_sets_every_tuned_path_and_the_ladders_size():
    config = to_dict(tiny().pretrain)
    stage.apply_best(config, {"params": {"optim.lr": 0.004, "optim.weight_decay": 0.05},
                              "size": {"n_embd": 48, "max_steps": 123}})
    assert config["optim"]["lr"] == 0.004 and config["optim"]["weight_decay"] == 0.05
    assert config["model"]["n_embd"] == 48 and config["max_steps"] == 123
