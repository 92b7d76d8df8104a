"""AWS Batch: the hook (hook.py), the requests as pure functions (requests.py), the backend
(backend.py) and its settings block (settings.py)."""
