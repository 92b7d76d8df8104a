"""SageMaker Training and Processing: the hook (hook.py), the requests as pure functions
(requests.py), the backends (backend.py) and their settings blocks (settings.py)."""
