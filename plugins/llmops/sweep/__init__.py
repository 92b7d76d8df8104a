"""Hyperparameter sweeps and scaling ladders on the Airflow side.

- `study`: the Optuna study of a sweep, in a database the Airflow tasks and the trial jobs share;
  one slot per mapped task, resumable across retries and reruns.
- `operator`: `TrialOperator`, a JobOperator that runs a slot's trial as a job and tells the study
  how it ended (complete, pruned, failed).
- `stage`: the lifecycle DAG's sweep steps: plan the slots, pick the best trial, hand its config to
  pretraining.
- `budget`: accelerator-hour estimates; a sweep or ladder over its budget refuses to start.
- `pool`: the Airflow pool that bounds how many trials and rungs run at once (the GPU quota).
- `tuning`: the same search as one SageMaker CreateHyperParameterTuningJob request.
- `ladder`: the scaling_ladder DAG's steps.

Nothing heavy at import: Optuna and MLflow are imported inside the functions that use them.
"""

from __future__ import annotations

# The Airflow pool every trial and ladder rung runs in: its slots are the team's accelerator quota
# for experiments. Created by `make demo` / `make up` (scripts/) and the tests; on MWAA create it
# once with `airflow pools set llmops_sweep <slots> "..."` (README, "Sweeps and scaling ladders").
POOL = "llmops_sweep"
POOL_DEFAULT_SLOTS = 2
POOL_DESCRIPTION = ("Accelerator quota for sweep trials and scaling-ladder rungs (llmops); "
                    "one slot per concurrent trial job.")

# Assets: the best config of a DAG's sweep, and the scaling ladder's latest recommendation (its
# event's `extra` holds the law and the compute-optimal N and D); see stage.py and ladder.py.
SWEEP_BEST_URI = "llmops://sweeps/{dag_id}/best"
LADDER_RECOMMENDATION_URI = "llmops://scaling/recommendation"
