"""A run and its stages on the Airflow side: start_run's checks (lifecycle), each stage's JobSpec
(specs), reuse and replay of earlier runs, retraining, the run's summary (run_summary), the
sweep (sweep_stage, and sweep_tuning for SageMaker's tuner) and the scaling ladder
(ladder_stage). What a stage's job runs is tasks/<stage>.py."""
