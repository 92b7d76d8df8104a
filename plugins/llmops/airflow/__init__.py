"""Airflow's side: the operators (operators/: JobOperator and its parts, TrialOperator), the
deferred JobTrigger (triggers/), the run page and its charts, the run's note, the pause page and
the sweep's pool, registered with Airflow by plugins/llmops_plugins.py. The top of plugins/llmops:
nothing here is imported by the layers below."""
