"""What the layers above stand on: AWS clients, hooks and S3 (aws/), MLflow's conventions
(tracking), the job ledger (ledger/), the step cache (step_cache), alerts (notify). Imports only
llmops.core."""
