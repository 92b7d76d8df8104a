"""A Ray cluster through the Ray Jobs REST API: the client (ray_hook.py), the backend (ray_backend.py)
and its settings block (ray_settings.py)."""
