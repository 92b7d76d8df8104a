"""Promotion as a researcher meets it, through the lifecycle DAG and its Params only: a run that
differs from the champion's only in its seeds does not replace it, and the gate says why in the
words and numbers it decided by; a contaminated suite refuses the run through the Param
max_contaminated_share. `airflow dags test` on the tiny recipe, against the session's first tiny
run (tests/lifecycle_run.py), whose student is the `llm-lifecycle` champion."""

from __future__ import annotations

import json
import os

import pytest

from tests.lifecycle_run import run_lifecycle

# Two tiny lifecycle runs when this module starts the session's first one (6-8 min at load 2-4):
# `make test-slow` runs it, sharing that first run with tests/test_pause_resume_dag.py; the suite
# skips it (LLMOPS_SLOW_TESTS).
pytestmark = [pytest.mark.timeout(1800),
              pytest.mark.skipif(not os.environ.get("LLMOPS_SLOW_TESTS"),
                                 reason="a lifecycle DAG run besides the session's tiny one: "
                                        "make test-slow runs it (LLMOPS_SLOW_TESTS=1)")]

HELD_OUT = "heldout.bits_per_byte"
# only the seeds differ from the champion's run (TINY_CONF); the tiny recipe's prose cloze holds 2
# of its 20 items in the training text (tests/test_contamination.py), over a 5% share
SEEDS = {"pretrain_seed": 1438, "finetune_seed": 1439, "distill_seed": 1440}
CONF = {"recipe": "tiny", **SEEDS, "max_contaminated_share": 0.05}


def test_noise_never_replaces_the_champion_and_a_contaminated_suite_refuses(tiny_lifecycle_run):
    from llmops.policy import promotion

    client = tiny_lifecycle_run["client"]
    before = client.get_model_version_by_alias("llm-lifecycle", "champion")
    assert before.tags["run_id"] == tiny_lifecycle_run["run_id"], "the first tiny run is the champion"

    run = run_lifecycle(CONF)
    after = client.get_model_version_by_alias("llm-lifecycle", "champion")
    assert after.version == before.version, "a seed-only challenger replaced the champion"
    assert "promote" in run["output"] and "refused, kept as `challenger`" in run["output"]

    kept = client.get_model_version_by_alias("llm-lifecycle", "challenger")
    assert kept.tags["run_id"] == run["run_id"] and kept.tags["gate.passed"] == "false"
    reasons = kept.tags["gate.reasons"]
    # the primary metric, in the words and numbers it decided by
    assert f"{HELD_OUT}: the challenger is not better by at least 1.50%" in reasons or \
        f"{HELD_OUT}: not enough evidence that the challenger is better by at least 1.50%" in reasons, reasons
    assert "documents (" in reasons and "tokens) " not in reasons.split(HELD_OUT)[0]
    assert "suite.prose_cloze.accuracy: 2 of 20 items (10%) appear in the training data, more " \
           "than max_contaminated_share 5%" in reasons
    assert kept.tags[f"gate.paired.{HELD_OUT}"].endswith(")") and "MDE" in kept.tags[f"gate.paired.{HELD_OUT}"]

    decision = json.loads(open(client.download_artifacts(run["parent"].info.run_id,
                                                         promotion.DECISION_ARTIFACT)).read())
    assert decision["outcome"] == "refused" and decision["candidate"] == "student"
    assert decision["thresholds"]["max_contaminated_share"] == 0.05
    assert decision["rules"][HELD_OUT] == {"policy": "superior", "margin": 0.015, "decides": True}
    compared = decision["models"]["student"]["comparisons"][HELD_OUT]
    assert compared["verdict"] != "pass" and compared["clusters"] >= 5 and compared["tokens"] > 1000
    assert abs(compared["diff"]) < 0.015, "a seed-only change moved the held-out text by 1.5%"
    assert decision["contamination"]["suite.prose_cloze.accuracy"] == {"contaminated": 2, "items": 20}
