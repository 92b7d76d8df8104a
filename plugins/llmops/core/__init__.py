"""The Airflow side's ground floor: where things live (settings), which paths a run may use
(paths), which code ran (provenance), a run's shape (run). Imports nothing of llmops above it."""
