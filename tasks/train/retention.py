"""Which checkpoints a job keeps: the newest `keep_last`, plus every step that is a multiple of
`keep_every`, so that a run keeps points to go back to or fork from without keeping them all.

One rule for local disk (tasks/train/checkpoint.py) and the S3 mirror
(tasks/train/checkpoint_s3.py), which each list their own committed steps and delete what `prunable`
returns. Only committed steps are ever listed (a local step_* directory appears by a rename once
complete; an S3 step counts once its manifest is up), so a checkpoint being written is never a
candidate; the step just committed is passed as `newest` and is never deleted either, even where
stale higher-numbered steps from before a rollback outnumber it. Standard library only: the mirror
imports it.
"""

from __future__ import annotations

from typing import Iterable


def prunable(steps: Iterable[int], *, keep_last: int, keep_every: int = 0,
             newest: int | None = None) -> list[int]:
    """The steps to delete, highest first: all but the `keep_last` highest, the multiples of
    `keep_every` (0: none) and `newest`."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (the newest checkpoint is always kept), got "
                         f"{keep_last}.")
    ordered = sorted(set(steps), reverse=True)
    return [s for s in ordered[keep_last:]
            if s != newest and not (keep_every and s % keep_every == 0)]
