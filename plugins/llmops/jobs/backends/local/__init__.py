"""The local backend: a job as processes on this machine (local_backend), each under a runner that
outlives the Airflow worker and records how the job ended (local_runner)."""
