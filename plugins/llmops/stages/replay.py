"""Replay a recorded lifecycle run from its MLflow record, and say whether it reproduced.

    python -m llmops.stages.replay RUN [--start-at sweep|pretrain] [--check-only] [--compare-with
    REPLAY]

RUN is the original's MLflow parent run id (or its DAG run id). The replay:

1. reads the record: the conf the run was triggered with (`run_conf.json` on the parent run),
   the code version it ran (`code_version` tag: the commit, plus a hash of uncommitted changes),
   and data prep's step record (its outputs' hashes and the data hash);
2. refuses, saying which, when the code version is not this checkout's (check out the recorded
   commit) or the recorded data cannot be matched: data prep's outputs gone or changed, or their
   manifest no longer agreeing with its files or with the recorded data hash;
3. triggers llm_lifecycle with the recorded conf, plus `from_run` = the original and `start_at`
   (sweep by default: the data set is the original's, verified; the sweep, pretraining and
   everything after it are computed again), `cache` off (nothing may stand in for a recomputed
   stage), and its models registered as `<name>-replay` (a replay never moves the champion of
   the model it reproduces). Here, the CLI runs it in this environment (`airflow dags test`, a
   developer machine or CI); in a deployment, the `llm_replay` DAG does the same from the UI;
4. compares the replay with the original, per training stage: the train and validation loss
   curves step by step (bitwise: MLflow keeps the float64 of every logged value) and the final
   weights (model.safetensors' sha256: equal tensors are written as equal bytes). The report goes
   to the task log or stdout and onto the replay's parent run (`replay_report.json`, tags
   `replay_of`, `replay_identical`). On CPU every comparison is identical; on GPUs the kernels
   are not bitwise deterministic, so expect curves that agree to a few decimals.

Exit status: 0 identical, 1 reproduced with differences, 2 refused.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

from llmops.core import provenance
from llmops.infra import step_cache, tracking
from llmops.stages import reuse

log = logging.getLogger(__name__)

DAG_ID = "llm_lifecycle"
TRAINING_STAGES = ("pretrain", "finetune", "distill")
CURVES = ("loss/train", "loss/val")
REPORT_ARTIFACT = "replay_report.json"
REPLAY_START_AT = ("sweep", "pretrain")


class ReplayRefused(ValueError):
    """The recorded run cannot be replayed here; the message says which part cannot be matched."""


def plan(run: str, start_at: str = "sweep", dag_id: str = DAG_ID) -> dict[str, Any]:
    """Check that `run` can be replayed here; the conf that replays it. Raises ReplayRefused."""
    if start_at not in REPLAY_START_AT:
        raise ReplayRefused(f"start_at must be one of {', '.join(REPLAY_START_AT)} (the stages from "
                            f"it on are computed again and compared), got {start_at!r}.")
    try:
        parent = reuse.find_parent(run, dag_id)
    except reuse.FromRunError as exc:
        raise ReplayRefused(str(exc).replace("Param 'from_run': ", "")) from None
    tags = parent.data.tags
    conf = tracking.read_json_artifact(parent.info.run_id, reuse.RUN_CONF_ARTIFACT)
    if conf is None:
        raise ReplayRefused(f"Run {tags.get('run_id')} (MLflow {parent.info.run_id}) has no recorded "
                            f"conf ({reuse.RUN_CONF_ARTIFACT}): it ran before replays were recorded.")
    recorded = tags.get("code_version") or tags.get("git_commit") or "unknown"
    here = provenance.code_version()
    if recorded == "unknown" or recorded != here:
        raise ReplayRefused(
            f"The code commit cannot be matched: run {tags.get('run_id')} ran code version "
            f"{recorded}, this checkout is {here}. Check out {recorded.split('-dirty')[0]} (with "
            "the same uncommitted changes, if the version says -dirty) and replay from there.")
    try:
        record = reuse.stage_record(parent, "data_prep")
    except reuse.FromRunError as exc:
        raise ReplayRefused(f"The recorded data hash cannot be matched: {exc}") from None
    data_hash = (record.get("result") or {}).get("data_hash", "")
    problem = step_cache.verify(record)
    if problem:
        raise ReplayRefused(f"The recorded data hash {data_hash[:12]} cannot be matched: {problem}. "
                            "The run's data set is no longer the one it trained on.")
    earlier = conf.get("from_run") and conf.get("start_at")
    name = (conf.get("registered_model_name") or "llm-lifecycle")[:120]
    replay_conf = {**conf, "cache": False, "registered_model_name": f"{name}-replay"}
    if not earlier:  # a run that started from another one replays from that one, as it did
        replay_conf.update(from_run=tags.get("run_id"), start_at=start_at)
    return {"original": parent.info.run_id, "original_run_id": tags.get("run_id"), "conf": replay_conf,
            "code_version": here, "data_hash": data_hash}


# -- the comparison -----------------------------------------------------------------------------

def _stage_run(parent_run_id: str, stage: str) -> Any | None:
    c = tracking.client()
    exp = c.get_run(parent_run_id).info.experiment_id
    runs = c.search_runs([exp], f"tags.`mlflow.parentRunId` = '{parent_run_id}' and "
                                f"tags.stage = '{stage}' and tags.task_id = '{stage}'",
                         order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0] if runs else None


def _curve(run: Any, key: str) -> list[tuple[int, float]]:
    source = run.data.tags.get("cached_from") or run.info.run_id  # a reused stage: its producer's
    return sorted((m.step, m.value) for m in tracking.client().get_metric_history(source, key))


def _weights(run: Any) -> str | None:
    record = tracking.read_json_artifact(run.info.run_id, step_cache.RECORD_ARTIFACT) or {}
    files = ((record.get("outputs") or {}).get("model_dir") or {}).get("files") or {}
    # model directories before the Hugging Face format held model.pt
    return files.get("model.safetensors") or files.get("model.pt")


def compare(original: str, replayed: str) -> dict[str, Any]:
    """Per training stage the replay computed again, its loss curves and final weights against
    the original's (a stage both take from the same earlier run is no comparison)."""
    stages: dict[str, Any] = {}
    for stage in TRAINING_STAGES:
        a, b = _stage_run(original, stage), _stage_run(replayed, stage)
        if a is None or b is None or b.data.tags.get("cached_from"):
            continue
        out: dict[str, Any] = {}
        for key in CURVES:
            ca, cb = _curve(a, key), _curve(b, key)
            diffs = [abs(x[1] - y[1]) for x, y in zip(ca, cb)]
            out[key] = {"points": len(ca), "identical": ca == cb and bool(ca),
                        "max_abs_diff": max(diffs) if diffs and len(ca) == len(cb) else None,
                        "steps": [len(ca), len(cb)]}
        wa, wb = _weights(a), _weights(b)
        out["weights"] = {"identical": wa is not None and wa == wb, "original": wa, "replay": wb}
        out["identical"] = all(v["identical"] for v in out.values() if isinstance(v, dict))
        stages[stage] = out
    return {"original": original, "replay": replayed, "stages": stages,
            "identical": bool(stages) and all(s["identical"] for s in stages.values())}


def record_report(report: dict[str, Any]) -> None:
    c = tracking.client()
    tracking.log_json(report["replay"], report, REPORT_ARTIFACT)
    c.set_tag(report["replay"], "replay_of", report["original"])
    c.set_tag(report["replay"], "replay_identical", str(report["identical"]).lower())


def describe(report: dict[str, Any]) -> list[str]:
    """The report in a few lines, for a log or a terminal."""
    lines = [f"Replay {report['replay']} of {report['original']}: "
             f"{'IDENTICAL' if report['identical'] else 'DIFFERS'}"]
    for stage, out in report["stages"].items():
        parts = []
        for key in CURVES:
            c = out[key]
            parts.append(f"{key} {c['points']} points " + (
                "bitwise equal" if c["identical"] else f"differ (max |diff| {c['max_abs_diff']})"))
        w = out["weights"]
        parts.append("weights bitwise equal (" + str(w["original"])[7:19] + ")" if w["identical"]
                     else f"weights differ ({w['original']} vs {w['replay']})")
        lines.append(f"  {stage}: " + "; ".join(parts))
    return lines


# -- the CLI ------------------------------------------------------------------------------------

def run_here(conf: dict[str, Any], log_path: str) -> str:
    """Run llm_lifecycle with `conf` in this environment (`airflow dags test`); its DAG run id."""
    bin_dir = os.path.dirname(sys.executable)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    with open(log_path, "w") as out:
        proc = subprocess.run([os.path.join(bin_dir, "airflow"), "dags", "test", DAG_ID, "-c",
                               json.dumps(conf)], stdout=out, stderr=subprocess.STDOUT, env=env)
    text = open(log_path).read()
    found = re.search(rf"DagRun Finished: dag_id={DAG_ID}, .*?run_id=([^,\s]+),.*?state=(\w+)", text)
    if proc.returncode != 0 or not found or found.group(2) != "success":
        raise RuntimeError(f"The replay run did not succeed (exit {proc.returncode}); its log: "
                           f"{log_path}\n" + "\n".join(text.splitlines()[-30:]))
    return found.group(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmops.stages.replay",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="the original's MLflow parent run id, or its DAG run id")
    parser.add_argument("--start-at", default="sweep", choices=REPLAY_START_AT,
                        help="the first stage computed again (default sweep: all but data prep)")
    parser.add_argument("--check-only", action="store_true",
                        help="check and print the conf that replays the run, trigger nothing")
    parser.add_argument("--compare-with", metavar="REPLAY",
                        help="compare with a replay that already ran (its MLflow parent run id or "
                             "DAG run id) instead of running one")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        planned = plan(args.run, args.start_at)
    except ReplayRefused as exc:
        print(f"Replay refused: {exc}", file=sys.stderr)
        return 2
    print(f"Replaying {planned['original_run_id']} (MLflow {planned['original']}): code "
          f"{planned['code_version']}, data {planned['data_hash'][:12]} verified")
    if args.check_only:
        print(json.dumps(planned["conf"], sort_keys=True))
        return 0
    if args.compare_with:
        replayed = reuse.find_parent(args.compare_with, DAG_ID).info.run_id
    else:
        log_path = os.path.join(tempfile.gettempdir(), f"llmops-replay-{planned['original']}.log")
        print(f"Running {DAG_ID} with {json.dumps(planned['conf'], sort_keys=True)} (log: {log_path})")
        run_id = run_here(planned["conf"], log_path)
        replayed = reuse.find_parent(run_id, DAG_ID).info.run_id
    report = compare(planned["original"], replayed)
    record_report(report)
    print("\n".join(describe(report)))
    print(json.dumps(report, sort_keys=True))
    return 0 if report["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
