"""AWS helpers for the remote backends: request validation against botocore's service models and
S3 transfers through the Amazon provider's hooks. Nothing here runs at import or DAG-parse time."""
