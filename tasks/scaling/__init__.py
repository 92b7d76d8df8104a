"""Scaling laws: plan a ladder of small runs, fit L(N, D) to their losses, size a big run.

- `ladder`: the rungs of a ladder (model width x tokens per parameter) and the model shape that
  has a recommended parameter count. Standard library only: the Airflow side plans with it.
- `law`: the Chinchilla fit (approach 3) and the compute-optimal N and D for a FLOP budget
  (numpy; scipy's L-BFGS when installed, else torch's).
"""
