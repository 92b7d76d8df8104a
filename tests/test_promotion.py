"""The promotion gate against a real MLflow registry: thresholds, then the paired comparison
with the champion on the same items (the held-out text, document by document, decides; every other
item-level metric is a guard); a passing challenger is registered with its lineage and becomes
`champion` (after an approval when asked); a worse one, or one the evidence cannot tell from the
champion, is kept as `challenger` with the reasons, and the champion does not move."""

from __future__ import annotations

import json

import pytest
import torch

from llmops.infra import tracking
from llmops.policy import promotion
from llmops.stages import retraining, specs
from tasks.configs import ConfigError, GateConfig, ModelConfig, to_dict

NAME = "promotion-test"
HELD_OUT = "heldout.bits_per_byte"


def gate_cfg(**overrides) -> GateConfig:
    return GateConfig(min_task_accuracy=0.5, max_perplexity=100.0, **overrides)


def metrics(name: str, accuracy: float, perplexity: float, bpb: float) -> dict[str, float]:
    return {f"{name}.task_accuracy": accuracy, f"{name}.perplexity": perplexity,
            f"{name}.bits_per_byte": bpb}


def documents(bpb: float, n: int = 40, wobble: float = 0.002) -> dict:
    """Held-out documents as evaluation reports them (per_item["heldout.bits_per_byte"]): each
    document's bits and bytes, documents of varying difficulty around `bpb`, and a per-document
    wobble a real pair of models has."""
    bits = [bpb * 1000 * (0.6 + 0.8 * (i % 7) / 6) * (1 + wobble * (-1) ** i) for i in range(n)]
    scale = bpb * 1000 * n / sum(bits)   # so the pooled bits per byte is `bpb`
    return {"kind": "continuous", "n": n, "keys": [f"doc{i}" for i in range(n)],
            "bits": [b * scale for b in bits], "bytes": [1000] * n, "tokens": 300 * n}


def per_item(correct: list[int], items: str = "sft-eval") -> dict:
    """Evaluation's per-item results (tasks/eval/suites.item_results) for `correct`."""
    import hashlib

    return {"n": len(correct), "items": hashlib.sha256(items.encode()).hexdigest()[:16],
            "correct": "".join(map(str, correct))}


def scored(name: str, accuracy: float, perplexity: float, bpb: float,
           correct: list[int] | None = None, wobble: float = 0.002) -> tuple[dict, dict]:
    """(metrics, the model's entry) as evaluation returns them for one model."""
    items = {HELD_OUT: documents(bpb, wobble=wobble)}
    if correct is not None:
        items["task_accuracy"] = per_item(correct)
    return metrics(name, accuracy, perplexity, bpb), {"per_item": items}


def two(ours: tuple, theirs: tuple | None) -> dict:
    """An evaluation of a challenger (and a champion) scored on the same items."""
    found, entry = scored("challenger", *ours)
    out = {"metrics": found, "models": {"challenger": entry}}
    if theirs is not None:   # its documents wobble the other way: a real pair is not equal per document
        found, entry = scored("champion", *theirs) if len(theirs) > 4 else \
            scored("champion", *theirs, *([None] if len(theirs) == 3 else []), -0.002)
        out["metrics"].update(found)
        out["models"]["champion"] = entry
    return out


def discordant(n: int, both: int, only_ours: int, only_theirs: int) -> tuple[list[int], list[int]]:
    ours = [1] * both + [1] * only_ours + [0] * only_theirs
    theirs = [1] * both + [0] * only_ours + [1] * only_theirs
    return ours + [0] * (n - len(ours)), theirs + [0] * (n - len(theirs))


def test_thresholds_name_each_reason_and_the_deciding_metric_needs_the_champion_s_items():
    gate = gate_cfg()
    evaluation = {"metrics": {**metrics("champion", 0.80, 40.0, 1.50),
                              **metrics("broken", 0.90, 5e6, 9.0),      # forgot its prose
                              **metrics("dull", 0.30, 40.0, 1.40)},
                  "models": {"champion": {}, "broken": {}, "dull": {}}}
    decisions = promotion.gate_decisions(gate, evaluation, ("broken", "dull", "missing"))
    assert decisions["broken"][0] == "perplexity 5000000.00 > 100.0"
    assert decisions["dull"][0] == "task accuracy 0.300 < 0.5"
    assert decisions["missing"][0] == "not evaluated"
    # a champion scored without per-document results: nothing can show the policy, so it stays,
    # whatever the point estimates say (1.40 < 1.50)
    assert decisions["dull"][1] == (f"{HELD_OUT}: not enough evidence: the champion was not "
                                    "scored on the same items")
    alone = {"metrics": metrics("good", 0.79, 41.0, 1.51), "models": {"good": {}}}
    assert promotion.gate_decisions(gate, alone, ("good",)) == {"good": []}


def test_the_held_out_text_decides_by_its_interval_not_the_point_estimate():
    """Same config, other seeds (0.2% better on the held-out text): kept, "not better by 1%",
    however surely the two models differ; 3% better: superior; a cheaper student 0.5% worse:
    non-inferior within 2%; the interval, the size and the test are in the reason."""
    superior = gate_cfg()
    noise = two((0.80, 40.0, 1.497), (0.80, 40.0, 1.500))
    reasons, compared = promotion.judge(superior, noise, ("challenger",))
    (reason,) = reasons["challenger"]
    assert reason.startswith(f"{HELD_OUT}: the challenger is not better by at least 1.00%: the "
                             "change -0.20% [") and "40 documents (12,000 tokens)" in reason
    c = compared["challenger"][HELD_OUT]
    assert c.high < 0 and c.decides and c.verdict == "fail"
    clear = two((0.80, 40.0, 1.455), (0.80, 40.0, 1.500))
    assert promotion.gate_decisions(superior, clear, ("challenger",)) == {"challenger": []}
    cheaper = gate_cfg(policy="non_inferior", margin=0.02)
    student = two((0.80, 40.0, 1.5075), (0.80, 40.0, 1.500))
    reasons, compared = promotion.judge(cheaper, student, ("challenger",))
    assert reasons == {"challenger": []}
    assert compared["challenger"][HELD_OUT].diff == pytest.approx(0.005, abs=1e-4)
    with pytest.raises(ConfigError, match="margin must be above 0 for policy non_inferior"):
        gate_cfg(policy="non_inferior", margin=0.0)


def test_a_comparison_that_cannot_decide_keeps_the_champion_saying_why():
    """Noisy per-document results: the interval straddles the 1% bound, and the reason says
    "not enough evidence", with the smallest change this evaluation could detect."""
    noisy = two((0.80, 40.0, 1.48, None, 0.05), (0.80, 40.0, 1.50))
    (reason,) = promotion.gate_decisions(gate_cfg(), noisy, ("challenger",))["challenger"]
    assert reason.startswith(f"{HELD_OUT}: not enough evidence that the challenger is better by "
                             "at least 1.00%: the change -1.3") and "includes -1.00%" in reason
    assert "the smallest change this comparison can detect is" in reason


def test_every_other_item_level_metric_is_a_guard():
    """task accuracy beside the held-out text: a drop shown on 400 items refuses a challenger
    that the held-out text would promote; a 20-item suite's drop that nothing shows does not."""
    ours, theirs = discordant(400, 250, 10, 60)
    dropped = two((0.65, 40.0, 1.40, ours), (0.775, 40.0, 1.50, theirs))
    reasons, compared = promotion.judge(gate_cfg(), dropped, ("challenger",))
    assert compared["challenger"]["task_accuracy"].policy == "guard"
    assert reasons["challenger"] == [compared["challenger"]["task_accuracy"].reason()]
    assert reasons["challenger"][0].startswith("task_accuracy: the challenger is worse: the change -0.125")
    ours, theirs = discordant(20, 10, 1, 3)
    small = two((0.55, 40.0, 1.40, ours), (0.65, 40.0, 1.50, theirs))
    assert promotion.gate_decisions(gate_cfg(), small, ("challenger",)) == {"challenger": []}


def test_the_harness_per_item_results_can_decide_and_unknown_metrics_are_refused():
    """lm-evaluation-harness's per-item results (tasks/eval/harness.py) are item-level metrics
    the gate compares item by item; a metric that is not is refused by name."""
    ours, theirs = discordant(400, 250, 60, 10)
    evaluation = two((0.80, 40.0, 1.50), (0.80, 40.0, 1.50))
    for name, result in (("challenger", ours), ("champion", theirs)):
        evaluation["models"][name]["per_item"]["harness.sft_choice.acc"] = per_item(result, "choice")
    gate = gate_cfg(metrics=["harness.sft_choice.acc"], margin=0.05)
    reasons, compared = promotion.judge(gate, evaluation, ("challenger",))
    assert reasons == {"challenger": []}
    c = compared["challenger"]["harness.sft_choice.acc"]
    assert c.decides and c.test == "exact McNemar" and c.low > 0.05 and c.diff == pytest.approx(50 / 400)
    assert compared["challenger"][HELD_OUT].policy == "guard"
    with pytest.raises(ConfigError, match=r"'harness.sft_choice.left_out' is not compared item by item"):
        gate_cfg(metrics=["harness.sft_choice.left_out"])


@pytest.fixture(scope="module")
def model_uri(tiny_data_dir) -> str:
    """One real logged model (a tiny GPT with the tiny data's tokenizer, logged as every training
    stage logs its model); every version below registers it again."""
    import tempfile

    import mlflow

    from tasks.model.gpt import GPT
    from tasks.train.prepared_data import DataDir
    from tasks.train.export import publish_model

    data = DataDir(tiny_data_dir)
    mlflow.set_experiment("promotion-test")
    with mlflow.start_run(), tempfile.TemporaryDirectory() as out:
        torch.manual_seed(0)
        model = GPT(ModelConfig(vocab_size=300, block_size=16, n_layer=1, n_head=2, n_embd=16))
        _, uri = publish_model(model, out, stage="finetune", step=0, data_hash=data.content_hash,
                               tokenizer_path=data.tokenizer_path, source_checkpoint="-",
                               eos_id=data.eos_id)
        return uri


def lifecycle_run(run_id: str, **gate) -> dict:
    parent = tracking.start_parent_run(experiment="promotion-test", dag_id="llm_retrain",
                                       run_id=run_id, config={})
    return {"run_id": run_id, "dag_id": "llm_retrain", "model_name": NAME, "parent_run_id": parent,
            "config": {"gate": to_dict(gate_cfg(**gate))}, "root": f"/out/{run_id}",
            "backends": {}, "experiment": "promotion-test"}


def evaluation(model_uri: str, accuracy: float, perplexity: float, bpb: float,
               champion: tuple | None = None) -> dict:
    found = two((accuracy, perplexity, bpb), champion)
    found["models"]["challenger"].update(
        {"model_uri": model_uri, "model_dir": "/out/finetune/model", "mlflow_run_id": "train-run",
         "lineage": {"source_checkpoint": "/out/finetune/checkpoints/step_10",
                     "data_content_hash": "d" * 64, "parent_registered_version": f"{NAME}/1"}})
    if champion:
        found["models"]["champion"].update(model_ref=f"models:/{NAME}/1",
                                           lineage={"registered_version": "1"})
    return {**found, "mlflow_run_id": "eval-run"}


def test_gate_registers_promotes_refuses_and_waits_for_approval(model_uri):
    client = tracking.client()
    data = {"data_hash": "d" * 64}

    # the first model: nothing to beat, thresholds met -> champion, with its lineage
    first = promotion.promote(lifecycle_run("r1"), evaluation(model_uri, 0.80, 40.0, 1.50), data,
                              candidates=("challenger",))
    assert first["promoted"] and first["version"] == "1"
    mv = client.get_model_version_by_alias(NAME, "champion")
    assert str(mv.version) == "1"
    assert mv.tags["lineage.source_checkpoint"] == "/out/finetune/checkpoints/step_10"
    assert mv.tags["data_hash"] == "d" * 64 and mv.tags["training_run_id"] == "train-run"
    assert mv.tags["evaluation_run_id"] == "eval-run" and mv.tags["gate.passed"] == "true"
    assert mv.tags["challenger.task_accuracy"] == "0.8"
    assert "challenger" not in client.get_registered_model(NAME).aliases

    # a worse challenger: registered, kept as `challenger` with the reasons; champion stays
    run = lifecycle_run("r2")
    worse = promotion.promote(run, evaluation(model_uri, 0.70, 40.0, 1.56, (0.80, 40.0, 1.50)),
                              data, candidates=("challenger",))
    assert not worse["promoted"] and worse["alias"] == "challenger"
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == "1"
    kept = client.get_model_version_by_alias(NAME, "challenger")
    assert str(kept.version) == worse["version"] == "2"
    assert kept.tags["gate.passed"] == "false"
    assert kept.tags["gate.reasons"].startswith(f"{HELD_OUT}: the challenger is not better by at "
                                                "least 1.00%: the change +4.00% [")
    assert kept.tags[f"gate.paired.{HELD_OUT}"].startswith("+4.00% [")
    assert kept.tags["gate.compared_to"] == "1"
    assert client.get_run(run["parent_run_id"]).data.tags["gate"] == "refused"
    assert "refused, kept as `challenger`" in promotion.summary(worse)
    with pytest.raises(promotion.LifecycleGateError, match="stays `challenger`"):
        promotion.crown(run, worse)
    # a retried task registers nothing new
    again = promotion.gate(run, evaluation(model_uri, 0.70, 40.0, 1.56, (0.80, 40.0, 1.50)),
                           data, candidates=("challenger",))
    assert again["version"] == "2"

    # a better one, with a human in the loop: gate, then crown with the approver's answer
    run = lifecycle_run("r3", require_approval=True)
    decision = promotion.gate(run, evaluation(model_uri, 0.85, 38.0, 1.44, (0.80, 40.0, 1.50)),
                              data, candidates=("challenger",))
    assert decision["passed"] and retraining.next_step(run, decision) == "approve"
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == "1"  # not yet
    body = promotion.approval_body(decision)
    assert "| task_accuracy | 0.85 | 0.8 |" in body
    approval = {"chosen_options": ["Approve"], "responded_by_user": {"id": "7", "name": "ana"},
                "responded_at": "2026-12-01T10:00:00+00:00"}
    crowned = promotion.crown(run, decision, approval)
    mv = client.get_model_version_by_alias(NAME, "champion")
    assert str(mv.version) == crowned["version"] == "3"
    assert mv.tags["approval"] == "Approve by ana at 2026-12-01T10:00:00+00:00"
    assert "challenger" not in client.get_registered_model(NAME).aliases
    assert promotion.current_champion(NAME)["uri"] == f"models:/{NAME}/3"
    finished = retraining.finish(run, decision, approval, crowned)
    assert finished == {"outcome": "promoted", "version": "3"}
    assert client.get_run(run["parent_run_id"]).info.status == "FINISHED"


def test_the_paired_verdict_is_on_the_version_the_run_page_and_before_the_approver(model_uri):
    """The decision the gate made is where each reader looks: the version's tags, the approver's
    request (every comparison with its role, interval, size, test, MDE and verdict) and the
    DAG run's MLflow parent run (gate/decision.json: thresholds, rules, comparisons), which the
    run page reads."""
    client = tracking.client()
    ours, theirs = discordant(400, 250, 60, 10)
    found = evaluation(model_uri, sum(ours) / 400, 38.0, 1.44, (sum(theirs) / 400, 40.0, 1.50))
    found["models"]["challenger"]["per_item"]["task_accuracy"] = per_item(ours)
    found["models"]["champion"]["per_item"]["task_accuracy"] = per_item(theirs)
    run = lifecycle_run("p1", require_approval=True)
    decision = promotion.gate(run, found, {"data_hash": "d" * 64}, candidates=("challenger",))
    assert decision["passed"]
    tags = client.get_model_version(NAME, decision["version"]).tags
    # McNemar on 60 vs 10 discordant items: scipy.stats.binomtest(10, 70).pvalue = 8.0048e-10
    assert tags["gate.paired.task_accuracy"].startswith("+0.125 [") and \
        "400 items p=8e-10 guard: pass (MDE 0.0" in tags["gate.paired.task_accuracy"]
    assert tags[f"gate.paired.{HELD_OUT}"].startswith("-4.00% [") and \
        "40 documents (12,000 tokens)" in tags[f"gate.paired.{HELD_OUT}"] and \
        "superior(1.00%): pass" in tags[f"gate.paired.{HELD_OUT}"]
    body = promotion.approval_body(decision)
    assert "| metric | role | change | interval | size | test | p | MDE | verdict |" in body
    assert (f"| {HELD_OUT} | decides: superior by 1.00% | -4.00% | [" in body
            and "| 40 documents, 12,000 tokens | cluster-robust t over documents |" in body)
    assert "| task_accuracy | guard (0.000) | +0.125 | [+0.0" in body and "| 400 items | exact McNemar | 8e-10 |" in body
    assert "Contamination audit" not in body   # this evaluation ran no audit
    recorded = json.loads(open(client.download_artifacts(
        run["parent_run_id"], promotion.DECISION_ARTIFACT)).read())
    assert recorded["outcome"] == "passed" and recorded["version"] == decision["version"]
    assert recorded["thresholds"] == {"min_task_accuracy": 0.5, "max_perplexity": 100.0,
                                      "max_contaminated_share": 0.25, "exclude_contaminated": True,
                                      "confidence": 0.95, "power": 0.8}
    assert recorded["rules"] == {HELD_OUT: {"policy": "superior", "margin": 0.01, "decides": True},
                                 "task_accuracy": {"policy": "guard", "margin": 0.0, "decides": False}}
    held_out = recorded["models"]["challenger"]["comparisons"][HELD_OUT]
    assert held_out["verdict"] == "pass" and held_out["mde"] >= 0 and held_out["clusters"] == 40


def test_the_approver_sees_the_contamination_audit_beside_the_scores(model_uri):
    found = evaluation(model_uri, 0.85, 38.0, 1.44, (0.80, 40.0, 1.50))
    found["contamination"] = {"task_accuracy": {"contaminated": 3, "items": 28, "unchecked": 0}}
    run = lifecycle_run("c1", require_approval=True)
    decision = promotion.gate(run, found, {"data_hash": "d" * 64}, candidates=("challenger",))
    body = promotion.approval_body(decision)
    assert "Contamination audit: items found in the training data (left out of the scores" in body
    assert "| task_accuracy | 3 of 28 | 11% |" in body


def test_a_published_model_carries_the_hash_of_its_weights_and_tokenizer(tiny_data_dir, tmp_path):
    from tasks.model.gpt import GPT
    from tasks.train.prepared_data import DataDir
    from tasks.train.export import export_model, read_meta

    data = DataDir(tiny_data_dir)
    config = ModelConfig(vocab_size=300, block_size=16, n_layer=1, n_head=2, n_embd=16)
    hashes = []
    for seed, where in ((0, "a"), (0, "b"), (1, "c")):
        torch.manual_seed(seed)
        out = export_model(GPT(config), tmp_path / where, data.tokenizer_path, {"stage": "test"},
                           eos_id=data.eos_id)
        hashes.append(read_meta(out)["content_sha256"])
    assert hashes[0] == hashes[1] != hashes[2] and len(hashes[0]) == 64


def test_the_same_weights_are_never_registered_twice(model_uri):
    """Identical reruns publish byte-identical weights: the first registers them, the next ones
    find that version by its content hash and register nothing (issue 24, point 6)."""
    client = tracking.client()
    name = "promotion-test-content"
    found = evaluation(model_uri, 0.80, 40.0, 1.50)
    found["models"]["challenger"]["lineage"]["content_sha256"] = "c" * 64
    runs = [{**lifecycle_run(f"c{i}"), "model_name": name} for i in range(3)]
    first = promotion.promote(runs[0], found, {"data_hash": "d"}, candidates=("challenger",))
    assert first["promoted"] and first["version"] == "1" and not first.get("already_registered")
    pinned = promotion.pin(promotion.current_champion(name))
    assert pinned["version"] == "1" and pinned["content_sha256"] == "c" * 64
    for run in runs[1:]:
        # as evaluation hands it back for an identical rerun: the champion is the challenger's
        # weights, scored once as the challenger (the first run's job, from the step cache)
        decision = promotion.promote({**run, "champion": pinned}, found, {"data_hash": "d"},
                                     candidates=("challenger",))
        assert decision["already_registered"] and decision["version"] == "1"
        assert decision["champion_before"] == "1", "compared with the champion, by its version"
        assert promotion.summary(decision) == (f"{name} (challenger): the same weights as version "
                                               "1, the champion; nothing registered.")
    assert [str(mv.version) for mv in client.search_model_versions(f"name = '{name}'")] == ["1"]
    assert str(client.get_model_version_by_alias(name, "champion").version) == "1"
    other = evaluation(model_uri, 0.85, 38.0, 1.44, (0.80, 40.0, 1.50))
    other["models"]["challenger"]["lineage"]["content_sha256"] = "e" * 64   # new weights: registered
    assert promotion.promote({**lifecycle_run("c3"), "model_name": name}, other, {"data_hash": "d"},
                             candidates=("challenger",))["version"] == "2"


def test_a_fork_s_version_names_the_parent_run_and_step(model_uri):
    """A run whose pretraining forked an earlier run's at a step (Param fork_step): its version
    carries the parent pretraining's MLflow run, the step and the earlier DAG run; a run that
    forked nothing carries none of them (issue 24, point 1)."""
    client = tracking.client()
    name = "promotion-test-fork"
    fork = {"checkpoints": "/out/pretrain/checkpoints", "step": 10, "hash": "h" * 64,
            "parent_run_id": "parent-pretrain-run"}
    run = {**lifecycle_run("f1"), "model_name": name,
           "from_run": {"run_id": "manual__first", "parent_run_id": "first-parent", "fork": fork,
                        "start_at": "pretrain", "stages": {}, "sweep_best": None}}
    decision = promotion.gate(run, evaluation(model_uri, 0.80, 40.0, 1.50), {"data_hash": "d"},
                              candidates=("challenger",))
    tags = client.get_model_version(name, decision["version"]).tags
    assert (tags["fork.parent_run_id"], tags["fork.step"], tags["fork.from_run"]) == (
        "parent-pretrain-run", "10", "manual__first")
    assert tags["training_run_id"] == "train-run"  # beside the lineage it had before
    unforked = {**lifecycle_run("f2"), "model_name": name,
                "from_run": {"run_id": "manual__first", "start_at": "finetune", "fork": None}}
    other = promotion.gate(unforked, evaluation(model_uri, 0.81, 40.0, 1.50), {"data_hash": "d"},
                           candidates=("challenger",))
    assert other["version"] != decision["version"]
    assert not [k for k in client.get_model_version(name, other["version"]).tags if k.startswith("fork.")]


def test_the_champion_s_scores_come_with_this_run_s_reference_to_it():
    """Evaluation keys on the champion's weights: its scores may be an earlier job's, for the
    same weights under another version, or the scores of this run's model holding them. The gate
    sees them as the run's champion's, never under the earlier reference."""
    champion = {"version": "4", "uri": f"models:/{NAME}/4", "run_id": "train-4",
                "content_sha256": "c" * 64}
    run = {"dag_id": "llm_retrain", "run_id": "w1", "root": "/out/w1", "config": {}, "backends": {},
           "experiment": "promotion-test", "parent_run_id": "", "model_name": NAME, "champion": champion}
    found = evaluation("runs:/x/model", 0.80, 40.0, 1.50)
    found["models"]["challenger"]["lineage"]["content_sha256"] = "c" * 64
    same = promotion.with_champion(run, found)
    assert same["metrics"] == {**found["metrics"], **metrics("champion", 0.80, 40.0, 1.50)}
    entry = same["models"]["champion"]
    assert entry["model_ref"] == f"models:/{NAME}/4" and entry["mlflow_run_id"] == "train-4"
    assert entry["lineage"]["registered_version"] == "4" and entry["per_item"] == \
        found["models"]["challenger"]["per_item"]
    assert "champion" not in found["models"], "the evaluation handed in is not changed"

    stale = evaluation("runs:/x/model", 0.85, 38.0, 1.44, (0.80, 40.0, 1.50))  # scored as version 1
    stale["models"]["champion"]["lineage"]["content_sha256"] = "c" * 64
    fresh = promotion.with_champion(run, stale)["models"]["champion"]
    assert fresh["model_ref"] == f"models:/{NAME}/4" and fresh["lineage"]["registered_version"] == "4"
    other = {**run, "champion": {**champion, "content_sha256": "e" * 64}}   # other weights
    assert promotion.with_champion(other, stale) == stale
    assert promotion.with_champion(other, found) == found


def test_lifecycle_promote_prefers_the_student_and_falls_back_to_the_teacher(model_uri):
    client = tracking.client()
    name = "promotion-test-lifecycle"
    run = {**lifecycle_run("l1"), "model_name": name, "dag_id": "llm_lifecycle"}
    models = {n: {"model_uri": model_uri, "model_dir": f"/out/{n}", "mlflow_run_id": f"{n}-run"}
              for n in ("teacher", "student")}
    both = {"metrics": {**metrics("teacher", 0.9, 50.0, 1.4), **metrics("student", 0.4, 70.0, 1.6)},
            "models": models, "mlflow_run_id": "eval"}
    result = promotion.promote(run, both, {"data_hash": "h"})
    # the student misses min_task_accuracy 0.5, so the teacher ships
    assert result["promoted"] and result["candidate"] == "teacher"
    assert result["gate"]["student"] == ["task accuracy 0.400 < 0.5"]
    assert client.get_model_version_by_alias(name, "champion").tags["candidate"] == "teacher"


def test_the_challenger_is_one_model_so_a_bigger_teacher_never_stands_in_for_noise():
    """This run's student meets the thresholds but is only seed noise away from the champion; its
    teacher beats the champion by far. The challenger is the preferred model that meets the
    thresholds (the student): kept, and the teacher does not take the champion's place."""
    gate = gate_cfg()
    evaluation = two((0.80, 40.0, 1.498), (0.80, 40.0, 1.50))
    evaluation["models"]["student"] = evaluation["models"].pop("challenger")
    found, entry = scored("teacher", 0.90, 30.0, 1.30)
    evaluation["metrics"].update(found)
    evaluation["metrics"].update({k.replace("challenger.", "student."): v for k, v in
                                  metrics("challenger", 0.80, 40.0, 1.498).items()})
    evaluation["models"]["teacher"] = entry
    reasons, _ = promotion.judge(gate, evaluation)
    assert reasons["teacher"] == [] and reasons["student"]
    assert promotion.challenger(gate, evaluation) == "student"
    assert promotion.challenger(gate_cfg(prefer="teacher"), evaluation) == "teacher"


def test_job_specs_wire_the_cache_the_champion_and_the_retrained_model(model_uri):
    """The Airflow side of post-training: the teacher cache job and the student's job get the
    same DistillConfig but for teacher_cache; evaluation adds the current champion, pinned."""
    from tasks.configs import recipe

    run = {"run_id": "s1", "dag_id": "llm_lifecycle", "model_name": NAME, "parent_run_id": "p",
           "root": "/store/run", "experiment": "llm_lifecycle",
           "config": to_dict(recipe("tiny")), "backends": {s: "local" for s in
                                                           ("finetune", "distill", "evaluate")}}
    data = {"outputs": {"data_dir": "/data"}, "data_hash": "h"}
    teacher = {"outputs": {"model_dir": "/store/run/finetune/model"}, "mlflow_run_id": "t"}
    cache = specs.teacher_cache_spec(run, data, teacher)
    assert cache["entrypoint"] == "tasks.distill_cache" and cache["stage"] == "distill_cache"
    student = specs.distill_spec(run, data, teacher, cache={"outputs": {
        "teacher_cache": cache["config"]["teacher_cache"]}})
    assert student["entrypoint"] == "tasks.distill"
    assert student["config"] == cache["config"]
    assert student["config"]["teacher_cache"] == "/store/run/teacher_cache"

    current = promotion.current_champion(NAME)
    assert current is not None  # promoted by the test above
    spec = specs.evaluate_spec(run, data, teacher, teacher, teacher)
    assert spec["config"]["models"]["champion"] == current["uri"] == \
        f"models:/{NAME}/{current['version']}"
    retrain = {**run, "champion": {k: current[k] for k in ("version", "uri", "run_id")},
               "data": data}
    finetune = retraining.retrain_finetune_spec(retrain)
    assert finetune["config"]["base_model"] == current["uri"]
    challenger = {"outputs": {"model_dir": "/store/run/finetune/model"}, "mlflow_run_id": "c"}
    evaluate = retraining.retrain_evaluate_spec(retrain, challenger)
    assert evaluate["config"]["models"] == {"challenger": "/store/run/finetune/model",
                                            "champion": current["uri"]}
