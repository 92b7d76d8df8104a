"""Hooks: the provider's AWS hooks extended where a long, retried job needs more, and a small
client for the Ray Jobs REST API (no `ray` import on the Airflow side)."""
