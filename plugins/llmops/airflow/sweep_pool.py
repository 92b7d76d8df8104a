"""The Airflow pool that bounds how many sweep trials and ladder rungs run at once.

Its slots are the team's accelerator quota for experiments: with 2 slots, 8 trials run 2 at a time
whatever the executor's parallelism, across every DAG run that uses the pool.

A task whose pool does not exist is never scheduled (the scheduler only logs "Tasks using
non-existent pool"), so a missing pool would hang a run without a word. Two guards:

- set-up creates it: `python -m llmops.airflow.sweep_pool` (run by `make demo`, `make up` and the
tests)
  creates it with 2 slots when missing and leaves an existing one alone;
- a fall-back: the listener below, loaded by the scheduler with the project's plugins, creates the
  pool with the default slots when a DAG run that needs it starts and it is missing, and says so in
  the scheduler's log. (Task code cannot do this: Airflow 3 tasks have no access to pools.)

The pool counts deferred tasks (include_deferred): a trial waiting on a remote job in the
triggerer still holds its accelerators, so it keeps its slot. Without that, every deferred trial
would give its slot back and the quota would bound nothing. `ensure_pool` turns it on for a pool
made before (and says so).

Resize it any time: `airflow pools set llmops_sweep 4 "..." --include-deferred` or Admin -> Pools.
"""

from __future__ import annotations

import argparse
import logging
import sys

log = logging.getLogger(__name__)

# The Airflow pool every trial and ladder rung runs in: its slots are the team's accelerator quota
# for experiments. Created by `make demo` / `make up` (scripts/) and the tests; on MWAA create it
# once with `airflow pools set llmops_sweep <slots> "..."` (README, "Sweeps and scaling ladders").
POOL = "llmops_sweep"
POOL_DEFAULT_SLOTS = 2
POOL_DESCRIPTION = ("Accelerator quota for sweep trials and scaling-ladder rungs (llmops); "
                    "one slot per concurrent trial job.")


def ensure_pool(name: str = POOL, slots: int = POOL_DEFAULT_SLOTS,
                description: str = POOL_DESCRIPTION) -> tuple[int, bool]:
    """Create the pool unless it exists: (its slots, whether it was created now). An existing
    pool keeps its slots and description but is made to count deferred tasks. Needs the Airflow
    metadata database (set-up scripts, the scheduler), not a task."""
    from airflow.models.pool import Pool

    existing = Pool.get_pool(name)
    if existing is not None:
        if not existing.include_deferred:
            Pool.create_or_update_pool(name, existing.slots, existing.description or description,
                                       include_deferred=True,
                                       team_name=getattr(existing, "team_name", None))
            log.warning("Pool %r did not count deferred tasks: trials waiting on remote jobs gave "
                        "their slot back, so its %d slots limited nothing. It counts them now.",
                        name, existing.slots)
        return existing.slots, False
    Pool.create_or_update_pool(name, slots, description, include_deferred=True)
    return slots, True


# -- the fall-back: a listener on DAG runs, in the scheduler ----------------------------------

try:
    from airflow.listeners import hookimpl
except ImportError:  # pragma: no cover - not in an Airflow environment (a job image)
    hookimpl = None


if hookimpl is not None:
    @hookimpl
    def on_dag_run_running(dag_run, msg: str) -> None:
        """A run that needs the experiments pool is starting: create the pool if it is missing,
        so its trials are scheduled instead of waiting forever."""
        dag = getattr(dag_run, "dag", None)
        if dag is None or not any(getattr(t, "pool", None) == POOL for t in dag.tasks):
            return
        from sqlalchemy import select
        from sqlalchemy.orm import object_session

        from airflow.models.pool import Pool

        session = object_session(dag_run)
        if session is None or session.scalar(select(Pool).where(Pool.pool == POOL)) is not None:
            return
        # In the scheduler's own transaction: no second writer on the database.
        session.add(Pool(pool=POOL, slots=POOL_DEFAULT_SLOTS, description=POOL_DESCRIPTION,
                         include_deferred=True))
        session.flush()
        log.warning("DAG run %s/%s uses pool %r, which did not exist: created it with %d slots. "
                    "Set the team's quota with `airflow pools set %s <slots> \"...\"`.",
                    dag_run.dag_id, dag_run.run_id, POOL, POOL_DEFAULT_SLOTS, POOL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmops.airflow.sweep_pool",
                                     description="Create the experiments pool unless it exists.")
    parser.add_argument("--slots", type=int, default=POOL_DEFAULT_SLOTS,
                        help="slots for a new pool (an existing pool keeps its own)")
    args = parser.parse_args(argv)
    slots, created = ensure_pool(slots=args.slots)
    print(f"Airflow pool {POOL!r}: {slots} slots" + (" (created)" if created else " (exists)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
