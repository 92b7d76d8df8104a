"""A job, whatever runs it: the backend-neutral JobSpec (spec), watching a job (watch), chains of
attempts (continuation), failures and alerts, and one folder per backend under backends/ (its
backend, hook, requests and settings). Imports llmops.core and llmops.infra; knows nothing of
teams or runs (team overrides travel on the JobSpec)."""
