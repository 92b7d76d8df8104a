"""llmops: the Airflow side of the LLM lifecycle.

Importable on an MWAA worker: no torch, no ray, nothing heavy at import. Jobs are described by a
backend-neutral `JobSpec`, submitted by `JobOperator` to a backend (a local process here; SageMaker,
HyperPod, AWS Batch at scale), and tracked in MLflow under one parent run per DAG run.
"""
