"""AWS Batch: the hook (batch_hook.py), the requests as pure functions (batch_requests.py),
the backend (batch_backend.py) and its settings block (batch_settings.py)."""
