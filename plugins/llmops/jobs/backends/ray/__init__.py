"""A Ray cluster through the Ray Jobs REST API: the client (hook.py), the backend (backend.py) and
its settings block (settings.py)."""
