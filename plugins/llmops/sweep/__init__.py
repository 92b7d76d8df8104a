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
