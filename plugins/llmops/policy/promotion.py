"""The promotion gate: a challenger becomes `champion` only when it is good enough on its own and
not worse than the champion it would replace.

    judge            per candidate, the reasons it may not ship: the absolute thresholds
                     (GateConfig.min_task_accuracy, max_perplexity) and, when the evaluation also
                     scored the current champion on the same items, paired comparisons with it
                     (plugins/llmops/policy/paired.py): every metric of GateConfig.metrics (by
                     default the held-out text, document by document) must show GateConfig.policy
                     (superior by at least GateConfig.margin, or non-inferior within it) at
                     GateConfig.confidence; an interval that cannot decide keeps the champion
                     with "not enough evidence". Every other item-level metric both were scored
                     on is a guard, failing only when the challenger is shown worse beyond
                     GateConfig.guard_margin. Items the contamination audit found in the training
                     data are left out of every item-level score (GateConfig.exclude_contaminated),
                     and more than GateConfig.max_contaminated_share of them refuses every
                     candidate. The challenger is the preferred model (GateConfig.prefer) that
                     meets the thresholds, else the other one: one model is compared, so a bigger
                     teacher never replaces a student champion because this run's student did not.
    gate             registers the candidate as a model version with its lineage (data manifest,
                     checkpoint, parent runs, evaluation run; for a fork, fork.parent_run_id,
                     fork.step and fork.from_run) and the gate's verdict as tags; it
                     holds the alias `challenger` until crowned. A refused version keeps it, with
                     the reasons in the tag `gate.reasons`.
    crown            moves `champion` to a version that passed (after a human approval, when
                     the DAG asks for one: Airflow's ApprovalOperator).
    promote          gate + crown, for DAGs without an approval step.

The retraining DAG's own steps (start_retrain, next_step, finish) are in
plugins/llmops/stages/retraining.py. MLflow client only.
"""

from __future__ import annotations

import logging
from typing import Any

from llmops.core.run import Run
from llmops.infra import tracking
from llmops.policy import paired
from tasks import configs

log = logging.getLogger(__name__)

CHAMPION, CHALLENGER = "champion", "challenger"
# the metrics copied onto a registered version as tags "<candidate>.<metric>"
TAGGED_METRICS = ("task_accuracy", "perplexity", "bits_per_byte", "val_loss", "params")


class LifecycleGateError(RuntimeError):
    """No candidate met the gate (kept for callers that want to fail instead of skip)."""


# -- decisions ------------------------------------------------------------------------------------


def threshold_reasons(gate: configs.GateConfig, metrics: dict[str, float], name: str) -> list[str]:
    accuracy = metrics.get(f"{name}.task_accuracy")
    perplexity = metrics.get(f"{name}.perplexity")
    if accuracy is None or perplexity is None:
        return ["not evaluated"]
    reasons = []
    if accuracy < gate.min_task_accuracy:
        reasons.append(f"task accuracy {accuracy:.3f} < {gate.min_task_accuracy}")
    if perplexity > gate.max_perplexity:
        reasons.append(f"perplexity {perplexity:.2f} > {gate.max_perplexity}")
    return reasons


def rules(gate: configs.GateConfig) -> dict[str, dict[str, Any]]:
    """The deciding metrics' rules: {metric: {policy, margin, decides}} (guards: guard_margin)."""
    return {m: {"policy": gate.policy, "margin": gate.margin, "decides": True} for m in gate.metrics}


def paired_comparisons(gate: configs.GateConfig, evaluation: dict[str, Any], name: str,
                       champion: str = CHAMPION) -> dict[str, paired.Comparison]:
    """`name` against `champion` on every item-level metric both were scored on, on the same
    items: the deciding ones (GateConfig.metrics) by the policy, the rest as guards; items seen
    in the training data are left out of both when GateConfig.exclude_contaminated. Empty when
    no champion was evaluated."""
    models = evaluation.get("models", {})
    ours = (models.get(name) or {}).get("per_item") or {}
    theirs = (models.get(champion) or {}).get("per_item") or {}
    compared = {}
    for metric in [*gate.metrics, *sorted(set(ours) - set(gate.metrics))]:
        a, b = ours.get(metric), theirs.get(metric)
        if not paired.same_items(a, b):
            continue
        if gate.exclude_contaminated and paired.kind_of(a) == "binary":
            drop = paired.seen(a) | paired.seen(b)
            a, b = paired.without(a, drop), paired.without(b, drop)
        if a["n"]:
            decides = metric in gate.metrics
            compared[metric] = paired.compare(
                metric, a, b, policy=gate.policy if decides else "superior",
                margin=gate.margin if decides else gate.guard_margin,
                role="decides" if decides else "guard", confidence=gate.confidence,
                power=gate.power)
    return compared


def champion_reasons(gate: configs.GateConfig, evaluation: dict[str, Any],
                     compared: dict[str, paired.Comparison], champion: str = CHAMPION) -> list[str]:
    """Why a challenger may not replace the champion: a comparison that did not pass, and a
    deciding metric that could not be compared (the champion scored on other items, or not item
    by item): then nothing shows the policy, and the champion stays. Empty when no champion was
    evaluated (the first model has nothing to beat)."""
    if champion not in (evaluation.get("models") or {}):
        return []
    missing = [f"{m}: not enough evidence: the champion was not scored on the same items"
               for m in gate.metrics if m not in compared]
    return missing + [c.reason() for c in compared.values() if not c.passed]


def clean_metrics(gate: configs.GateConfig, evaluation: dict[str, Any]) -> dict[str, float]:
    """The evaluation's metrics, with every item-level one recomputed without the items the
    contamination audit found in the training data (when GateConfig.exclude_contaminated)."""
    metrics = dict(evaluation["metrics"])
    if not gate.exclude_contaminated:
        return metrics
    for name, model in (evaluation.get("models") or {}).items():
        for metric, result in ((model or {}).get("per_item") or {}).items():
            drop = paired.seen(result)
            if drop and f"{name}.{metric}" in metrics:
                metrics[f"{name}.{metric}"] = paired.accuracy(paired.without(result, drop))
    return metrics


def contamination_reasons(gate: configs.GateConfig, evaluation: dict[str, Any]) -> list[str]:
    """Why no score of this evaluation can be trusted: too many items seen in training."""
    reasons = []
    for metric, found in sorted((evaluation.get("contamination") or {}).items()):
        share = found["contaminated"] / max(found["items"], 1)
        if share > gate.max_contaminated_share:
            reasons.append(f"{metric}: {found['contaminated']} of {found['items']} items "
                           f"({share:.0%}) appear in the training data, more than "
                           f"max_contaminated_share {gate.max_contaminated_share:.0%} "
                           f"(contamination.json lists them)")
    return reasons


def judge(gate: configs.GateConfig, evaluation: dict[str, Any],
          candidates: tuple[str, ...] = ("teacher", "student")
          ) -> tuple[dict[str, list[str]], dict[str, dict[str, paired.Comparison]]]:
    """Per candidate, the reasons it may not ship (thresholds, the comparisons with the
    champion, contamination) and its paired comparisons."""
    metrics = clean_metrics(gate, evaluation)
    leaked = contamination_reasons(gate, evaluation)
    reasons, comparisons = {}, {}
    for name in candidates:
        compared = paired_comparisons(gate, evaluation, name)
        reasons[name] = (threshold_reasons(gate, metrics, name)
                         + champion_reasons(gate, evaluation, compared) + leaked)
        comparisons[name] = compared
    return reasons, comparisons


def gate_decisions(gate: configs.GateConfig, evaluation: dict[str, Any],
                   candidates: tuple[str, ...] = ("teacher", "student")) -> dict[str, list[str]]:
    """For each candidate, the reasons it may not ship (an empty list means it passes)."""
    return judge(gate, evaluation, candidates)[0]


def challenger(gate: configs.GateConfig, evaluation: dict[str, Any],
               candidates: tuple[str, ...] = ("teacher", "student")) -> str | None:
    """The one model this run puts up against the champion: the preferred one that meets the
    absolute thresholds, else the other that does, else the preferred one evaluated (refused)."""
    metrics = clean_metrics(gate, evaluation)
    evaluated = [n for n in _order(gate, candidates) if n in evaluation.get("models", {})]
    fit = [n for n in evaluated if not threshold_reasons(gate, metrics, n)]
    return (fit or evaluated or [None])[0]


def _order(gate: configs.GateConfig, candidates: tuple[str, ...]) -> list[str]:
    return sorted(candidates, key=lambda n: n != gate.prefer)  # stable: the preferred one first


# -- the registry ---------------------------------------------------------------------------------


def current_champion(model_name: str) -> dict[str, Any] | None:
    """The version holding `champion`, pinned by number, or None when there is none yet.
    `content_sha256`: the hash of its weights and tokenizer ("" for a version registered
    without it), what evaluation keys on instead of the version."""
    from mlflow.exceptions import MlflowException

    client = tracking.client()
    try:
        mv = client.get_model_version_by_alias(model_name, CHAMPION)
    except MlflowException:
        return None
    return {"version": str(mv.version), "uri": f"models:/{model_name}/{mv.version}",
            "run_id": mv.tags.get("training_run_id") or mv.run_id or "",
            "content_sha256": mv.tags.get("lineage.content_sha256", ""), "tags": dict(mv.tags)}


def pin(champion: dict[str, Any] | None) -> dict[str, Any] | None:
    """What a run keeps of the champion it starts with (start_run, start_retrain)."""
    if champion is None:
        return None
    return {k: champion.get(k, "") for k in ("version", "uri", "run_id", "content_sha256")}


def same_weights(champion: dict[str, Any] | None, contents: dict[str, str]) -> str | None:
    """The name (among `contents`: name -> content hash) of the model holding exactly the
    champion's weights, or None: a model evaluated once stands for both."""
    content = (champion or {}).get("content_sha256")
    return next((name for name, c in contents.items() if content and c == content), None)


def with_champion(run: Run | dict[str, Any], evaluation: dict[str, Any]) -> dict[str, Any]:
    """The evaluation with the run's pinned champion as its `champion` entry. Evaluation keys
    on the champion's content, not its version: the scores may come from an earlier job (the
    step cache) that scored the same weights under another reference, or from the model of this
    run holding the champion's weights (scored once, see specs.evaluate_models_spec). The
    scores stand; the reference (URI, version, run) is the run's champion."""
    run = Run.of(run)
    champion = run.champion
    models = dict(evaluation.get("models") or {})
    if not champion or not champion.get("content_sha256"):
        return evaluation   # keyed by its URI (version): the entry is this champion's already
    metrics = dict(evaluation.get("metrics") or {})
    if CHAMPION not in models:
        name = same_weights(champion, {n: (m.get("lineage") or {}).get("content_sha256", "")
                                       for n, m in models.items()})
        if name is None:
            return evaluation
        models[CHAMPION] = models[name]
        metrics.update({f"{CHAMPION}.{k.split('.', 1)[1]}": v for k, v in metrics.items()
                        if k.startswith(f"{name}.")})
    entry = models[CHAMPION]
    if (entry.get("lineage") or {}).get("content_sha256") != champion["content_sha256"]:
        return evaluation   # not these weights: nothing to say about them
    models[CHAMPION] = {**entry, "model_ref": champion["uri"], "mlflow_run_id": champion["run_id"],
                        "lineage": {**(entry.get("lineage") or {}),
                                    "registered_model": run.model_name,
                                    "registered_version": champion["version"]}}
    return {**evaluation, "models": models, "metrics": metrics}


def registered_with_content(client: Any, name: str, content: str) -> Any | None:
    """The version of `name` holding exactly these weights and tokenizer, if one does."""
    if not content:
        return None
    found = client.search_model_versions(f"name = '{name}' and tags.`lineage.content_sha256` = '{content}'")
    return min(found, key=lambda mv: int(mv.version)) if found else None


def _register_once(client: Any, name: str, model_uri: str, lineage: dict[str, str]) -> str:
    """Register `model_uri` as a new version, or return the version this DAG run already
    registered for this candidate (a retried task must not register twice)."""
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name, description="Champion of the LLM lifecycle DAGs; "
                                                         "see the alias `champion`.")
    except MlflowException:
        pass  # already exists
    for mv in client.search_model_versions(f"name = '{name}'"):
        if all(mv.tags.get(k) == lineage[k] for k in ("run_id", "dag_id", "candidate")):
            return mv.version
    import mlflow

    mlflow.set_tracking_uri(tracking.tracking_uri())
    mlflow.set_registry_uri(tracking.tracking_uri())
    return mlflow.register_model(model_uri, name, tags=lineage).version


def fork_lineage(run: Run | dict[str, Any]) -> dict[str, str]:
    """For a run whose pretraining forked an earlier one's (Param fork_step): the parent
    pretraining's MLflow run, the step, and the earlier DAG run, as the version's tags (the
    same names as on the fork's MLflow run). Empty for a run that forked nothing."""
    earlier = Run.of(run).from_run or {}
    fork = earlier.get("fork")
    if not fork:
        return {}
    return {"fork.parent_run_id": str(fork.get("parent_run_id") or ""), "fork.step": str(fork["step"]),
            "fork.from_run": str(earlier.get("run_id") or "")}


DECISION_ARTIFACT = "gate/decision.json"   # on the DAG run's MLflow parent run: the run page reads it


def gate(run: Run | dict[str, Any], evaluation: dict[str, Any], data: dict[str, Any],
         candidates: tuple[str, ...] = ("teacher", "student")) -> dict[str, Any]:
    """Decide, register the challenger (promotion.challenger) with its lineage and verdict, and
    give it the alias `challenger`. Returns the decision, also logged on the parent run as
    DECISION_ARTIFACT with the thresholds and rules it applied."""
    run = Run.of(run)
    gate_cfg = configs.from_dict(configs.GateConfig, run.config["gate"])
    evaluation = with_champion(run, evaluation)
    decisions, comparisons = judge(gate_cfg, evaluation, candidates)
    chosen = challenger(gate_cfg, evaluation, candidates)
    passed = chosen is not None and not decisions[chosen]
    decision: dict[str, Any] = {"passed": passed, "candidate": chosen, "gate": decisions,
                                "comparisons": {n: {m: c.to_dict() for m, c in cs.items()}
                                                for n, cs in comparisons.items()},
                                "model_name": run.model_name, "version": None,
                                "champion_before": _champion_version(evaluation),
                                "thresholds": {k: getattr(gate_cfg, k) for k in (
                                    "min_task_accuracy", "max_perplexity", "max_contaminated_share",
                                    "exclude_contaminated", "confidence", "power")},
                                "rules": {**{m: {"policy": "guard", "margin": gate_cfg.guard_margin,
                                                 "decides": False}
                                             for cs in comparisons.values() for m in cs},
                                          **rules(gate_cfg)},
                                # the audit's counts per metric, for the approver (the items are
                                # in the evaluation run's contamination.json)
                                "contamination": {m: {k: found.get(k) for k in ("contaminated", "items")}
                                                  for m, found in sorted((evaluation.get("contamination")
                                                                          or {}).items())},
                                "contamination_excluded": gate_cfg.exclude_contaminated}
    if chosen is None:
        decision["reasons"] = "no candidate was evaluated"
        _log_decision(run, decision, "refused")
        return decision
    model = evaluation["models"][chosen]
    metrics = {k: v for k, v in evaluation["metrics"].items() if k.startswith(f"{chosen}.")}
    reasons = "; ".join(decisions[chosen])
    decision.update(reasons=reasons, metrics=metrics,
                    champion_metrics={k.split(".", 1)[1]: v for k, v in evaluation["metrics"].items()
                                      if k.startswith(f"{CHAMPION}.")})
    lineage = {"run_id": run.run_id, "dag_id": run.dag_id, "candidate": chosen,
               "data_hash": data.get("data_hash", ""), "model_dir": model.get("model_dir", ""),
               "training_run_id": model.get("mlflow_run_id") or "",
               "evaluation_run_id": evaluation.get("mlflow_run_id", ""),
               "lifecycle_run_id": run.parent_run_id,
               **{f"lineage.{k}": str(v) for k, v in (model.get("lineage") or {}).items()},
               **fork_lineage(run)}
    client = tracking.client()
    name = run.model_name
    same = registered_with_content(client, name, lineage.get("lineage.content_sha256", ""))
    if same is not None and same.tags.get("run_id") != run.run_id:
        # The same weights are registered already (an identical rerun, or the champion itself):
        # a second version would be a copy, and its verdict would overwrite nothing useful.
        decision.update(version=str(same.version), uri=f"models:/{name}/{same.version}",
                        already_registered=True)
        client.set_tag(run.parent_run_id, "gate", f"already registered as version {same.version}")
        if str(same.version) == str(decision["champion_before"] or ""):
            # the challenger is the champion itself (an identical rerun): nothing to compare, and
            # the run ends with its model as the champion it already is
            decision.update(passed=False, already_champion=True,
                            reasons=f"the same weights as version {same.version}, the champion")
            client.set_tag(run.parent_run_id, CHAMPION, f"{name}/{same.version}")
        _log_decision(run, decision, "already_registered")
        log.info("gate: %s (%s) is version %s already: nothing registered", name, chosen, same.version)
        return decision
    version = _register_once(client, name, model["model_uri"], lineage)
    tags = {"gate.passed": str(passed).lower(), "gate.reasons": reasons or "none",
            "gate.compared_to": decision["champion_before"] or "no champion yet",
            **{k: str(v) for k, v in metrics.items()
               if k.split(".", 1)[1] in TAGGED_METRICS or ".suite." in k},
            # the paired comparisons against the champion: change [interval] size p policy: verdict
            **{f"gate.paired.{m}": c.summary() for m, c in comparisons[chosen].items()}}
    for key, value in tags.items():
        client.set_model_version_tag(name, version, key, value[:5000])
    client.set_registered_model_alias(name, CHALLENGER, version)
    client.set_tag(run.parent_run_id, "gate", "passed" if passed else "refused")
    decision.update(version=str(version), uri=f"models:/{name}/{version}")
    _log_decision(run, decision, "passed" if passed else "refused")
    log.info("gate: %s version %s (%s) %s%s", name, version, chosen,
             "passed" if passed else "refused: ", "" if passed else reasons)
    return decision


def _log_decision(run: Run, decision: dict[str, Any], outcome: str) -> None:
    """The decision as the run page reads it: per model its reasons and comparisons."""
    record = {"outcome": outcome, "already_registered": bool(decision.get("already_registered")),
              "already_champion": bool(decision.get("already_champion")),
              **{k: decision.get(k) for k in ("candidate", "model_name", "version", "champion_before",
                                              "thresholds", "rules", "contamination", "reasons")},
              "models": {n: {"reasons": r, "comparisons": decision["comparisons"].get(n, {})}
                         for n, r in decision["gate"].items()}}
    try:
        tracking.log_json(run.parent_run_id, record, DECISION_ARTIFACT)
    except Exception as exc:  # noqa: BLE001 - the decision stands; the page shows the tags
        log.warning("Could not log the gate's decision on MLflow run %s: %s", run.parent_run_id, exc)


def _champion_version(evaluation: dict[str, Any]) -> str | None:
    champion = evaluation.get("models", {}).get(CHAMPION)
    if not champion:
        return None
    return champion.get("lineage", {}).get("registered_version") or champion.get("model_ref")


def crown(run: Run | dict[str, Any], decision: dict[str, Any],
          approval: dict[str, Any] | None = None) -> dict[str, Any]:
    """Point `champion` at the version the gate passed (and a human approved, if asked)."""
    run = Run.of(run)
    if not decision.get("passed"):
        raise LifecycleGateError(f"version {decision.get('version')} did not pass the gate "
                                 f"({decision.get('reasons')}); it stays `challenger`.")
    client = tracking.client()
    name, version = decision["model_name"], decision["version"]
    if approval:
        client.set_model_version_tag(name, version, "approval", approval_text(approval))
    client.set_registered_model_alias(name, CHAMPION, version)
    if str(client.get_registered_model(name).aliases.get(CHALLENGER)) == str(version):
        client.delete_registered_model_alias(name, CHALLENGER)
    client.set_tag(run.parent_run_id, CHAMPION, f"{name}/{version}")
    log.info("%s version %s is now `champion` (was %s)", name, version,
             decision.get("champion_before") or "none")
    return {**decision, "alias": CHAMPION}


def approval_text(approval: dict[str, Any]) -> str:
    """'Approve by admin at 2026-...' from the ApprovalOperator's XCom."""
    chosen = ", ".join(approval.get("chosen_options") or []) or "no answer"
    user = approval.get("responded_by_user") or {}
    who = user.get("name") or user.get("id") or "unknown" if isinstance(user, dict) else str(user)
    return f"{chosen} by {who} at {approval.get('responded_at')}"


def promote(run: Run | dict[str, Any], evaluation: dict[str, Any], data: dict[str, Any],
            candidates: tuple[str, ...] = ("teacher", "student")) -> dict[str, Any]:
    """The lifecycle DAG's last step: gate, then crown what passed. Ends the MLflow parent run.
    Returns the decision with `promoted`; a refused challenger is recorded, not raised."""
    run = Run.of(run)
    decision = gate(run, evaluation, data, candidates)
    if decision["passed"]:
        decision = crown(run, decision)
    tracking.end_run(run.parent_run_id, "FINISHED")
    return {**decision, "promoted": decision["passed"],
            "alias": CHAMPION if decision["passed"] or decision.get("already_champion") else CHALLENGER}


def summary(decision: dict[str, Any]) -> str:
    """One line for logs, skip messages and the approval request."""
    who = f"{decision['model_name']} version {decision.get('version')} ({decision.get('candidate')})"
    if decision.get("already_registered"):
        champion = ", the champion" if decision.get("already_champion") else ""
        refused = "" if decision.get("passed") or champion else \
            f", and the gate refused it: {decision.get('reasons')}"
        return (f"{decision['model_name']} ({decision.get('candidate')}): the same weights as "
                f"version {decision.get('version')}{champion}; nothing registered{refused}.")
    if decision.get("passed"):
        return f"{who} passed the gate against {decision.get('champion_before') or 'no champion'}."
    return f"{who} refused, kept as `challenger`: {decision.get('reasons')}"


def approval_body(decision: dict[str, Any]) -> str:
    """Markdown for the approver: the verdict and the challenger's numbers next to the
    champion's."""
    rows = []
    metrics = decision.get("metrics") or {}
    for key in sorted(metrics):
        metric = key.split(".", 1)[1]
        rows.append(f"| {metric} | {metrics[key]:.4g} | "
                    f"{_fmt((decision.get('champion_metrics') or {}).get(metric))} |")
    table = "\n".join(["| metric | challenger | champion |", "|---|---|---|", *rows])
    compared = (decision.get("comparisons") or {}).get(decision.get("candidate")) or {}
    if compared:   # the evidence: item by item against the champion, with its uncertainty
        rows = [_comparison_row(m, c) for m, c in sorted(compared.items(),
                                                         key=lambda mc: (not mc[1]["decides"], mc[0]))]
        conf = next(iter(compared.values()))["confidence"]
        table += ("\n\nPaired against the champion on the same items "
                  f"({conf:.0%} intervals; MDE: the smallest change each comparison can detect):\n\n"
                  "| metric | role | change | interval | size | test | p | MDE | verdict |\n"
                  "|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows))
    audit = decision.get("contamination") or {}
    if audit:   # how far the scores above can be trusted: items the model may have trained on
        fate = "left out of" if decision.get("contamination_excluded", True) else "counted in"
        rows = [f"| {m} | {c['contaminated']} of {c['items']} | "
                f"{c['contaminated'] / max(c['items'] or 0, 1):.0%} |" for m, c in audit.items()]
        table += (f"\n\nContamination audit: items found in the training data ({fate} the scores "
                  "above; the evaluation run's contamination.json lists them):\n\n"
                  "| metric | items found | share |\n|---|---|---|\n" + "\n".join(rows))
    return f"{summary(decision)}\n\n{table}\n"


def _comparison_row(metric: str, c: dict[str, Any]) -> str:
    fmt = (lambda v: f"{v:+.2%}") if c["unit"] == "relative" else (lambda v: f"{v:+.3f}")
    margin = fmt(c["margin"])[1:]
    role = {"superior": f"decides: superior by {margin}", "non_inferior": f"decides: non-inferior "
            f"within {margin}", "guard": f"guard ({margin})"}[c["policy"]]
    size = (f"{c['clusters']} documents, {c['tokens']:,} tokens" if c["kind"] == "continuous"
            else f"{c['n']} items" + (f", {c['clusters']} passages" if c["clusters"] < c["n"] else ""))
    return (f"| {metric} | {role} | {fmt(c['diff'])} | [{fmt(c['low'])}, {fmt(c['high'])}] | "
            f"{size} | {c['test']} | {c['p_value']:.3g} | {fmt(c['mde'])[1:]} | {c['verdict']} |")


def _fmt(value: Any) -> str:
    return "" if value is None else f"{value:.4g}"
