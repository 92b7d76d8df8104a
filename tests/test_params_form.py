"""The trigger form as Airflow 3.3's UI reads the Params: it submits with its defaults, nothing is
required that the help calls optional, enums name their empty choice, every Param sits in a
section and says its bounds, and a bad value is refused by name instead of clamped.

The UI rules these tests encode (airflow/ui FlexibleForm, 3.3): a Param is required when its
schema type does not include "null" and its value is None or ""; a number field clamps to a
top-level minimum/maximum when it loses focus; an enum option None is labelled "null" unless
`values_display` names it.
"""

from __future__ import annotations

import re

import pytest

from llmops.policy import params as knobs

BUILDERS = {"llm_lifecycle": knobs.lifecycle_params, "scaling_ladder": knobs.ladder_params,
            "llm_retrain": knobs.retrain_params}
SECTIONS = {knobs.DATA, knobs.MODEL, knobs.SWEEP, knobs.PRETRAINING, knobs.POST_TRAINING,
            knobs.GATE, knobs.WHERE, knobs.LADDER}


def ui_required(param) -> bool:
    kind = param.schema.get("type")
    nullable = isinstance(kind, list) and "null" in kind
    return bool(kind) and not nullable and param.value in (None, "")


def types_of(param) -> list[str]:
    kind = param.schema.get("type")
    return [kind] if isinstance(kind, str) else [k for k in kind if k != "null"]


@pytest.mark.parametrize("dag_id", sorted(BUILDERS))
def test_the_form_triggers_with_its_defaults(dag_id):
    from airflow.sdk.definitions.param import ParamsDict

    params = BUILDERS[dag_id]()
    ParamsDict(params).validate()  # what the API does with the defaults on trigger
    assert [name for name, p in params.items() if ui_required(p)] == []


def test_the_serialized_dag_keeps_the_form_schema():
    """What the UI gets is the serialized DAG's params: the same rules hold after the round trip."""
    from airflow.dag_processing.dagbag import DagBag
    from airflow.serialization.serialized_objects import DagSerialization

    from tests.test_dags import ROOT

    dag = DagBag(dag_folder=str(ROOT / "dags")).dags["llm_lifecycle"]
    params = DagSerialization.from_dict(DagSerialization.to_dict(dag)).params
    assert [n for n in params if ui_required(params.get_param(n))] == []
    team = params.get_param("team")
    assert team.value is None and team.schema["section"] == knobs.WHERE
    assert params.get_param("sweep_sampler").schema["values_display"]["null"].startswith("(recipe")
    params.validate()


@pytest.mark.parametrize("dag_id", sorted(BUILDERS))
def test_every_param_the_help_calls_optional_is_nullable_with_no_default(dag_id):
    for name, param in BUILDERS[dag_id]().items():
        if re.search(r"\bempty\s*=", param.description or "", re.I):
            assert "null" in param.schema["type"], name
            assert param.value is None, name


@pytest.mark.parametrize("dag_id", sorted(BUILDERS))
def test_enums_name_their_empty_choice(dag_id):
    for name, param in BUILDERS[dag_id]().items():
        enum = param.schema.get("enum") or []
        if None in enum:
            label = (param.schema.get("values_display") or {}).get("null")
            assert label and label != "null", f"{name} shows a literal 'null' option"


def test_every_lifecycle_param_has_a_section_and_its_bounds_in_words():
    params = knobs.lifecycle_params()
    unsectioned = [n for n, p in params.items() if p.schema.get("section") not in SECTIONS]
    assert unsectioned == ["recipe"]  # first, above the sections: it sets every default
    for name, path in knobs.KNOBS.items():
        param = params[name]
        assert param.schema["section"] == knobs.section_of(path)
        lo, hi = knobs.schema_bounds(param.schema)
        if lo is not None and hi is not None:
            assert f"from {knobs._number(lo)} to {knobs._number(hi)}" in param.description, name
    assert params["n_layer"].schema["section"] == knobs.MODEL
    assert params["pretrain_steps"].schema["section"] == knobs.PRETRAINING
    assert params["student_n_embd"].schema["section"] == knobs.POST_TRAINING
    assert params["min_task_accuracy"].schema["section"] == knobs.GATE
    assert params["backend_pretrain"].schema["section"] == knobs.WHERE
    assert params["data_inputs"].schema["section"] == knobs.DATA
    assert params["sweep_trials"].schema["section"] == knobs.SWEEP
    for name in ("finetune_steps", "distill_steps"):
        assert params[name].description.startswith(("Fine-tuning optimizer steps",
                                                    "Distillation optimizer steps")), name


@pytest.mark.parametrize("dag_id", sorted(BUILDERS))
def test_no_number_field_clamps_what_is_typed(dag_id):
    """Bounds at the schema's top level make the form's number field clamp on blur."""
    for name, param in BUILDERS[dag_id]().items():
        assert "minimum" not in param.schema and "maximum" not in param.schema, name


def _numeric_knobs():
    params = knobs.lifecycle_params()
    for name, param in params.items():
        lo, hi = knobs.schema_bounds(param.schema)
        if lo is not None:
            yield name, lo - (1 if "integer" in types_of(param) else abs(lo) * 0.5 + 1e-3), lo, "minimum"
        if hi is not None:
            yield name, hi * 2 + 1, hi, "maximum"


@pytest.mark.parametrize("name, value, bound, which", list(_numeric_knobs()))
def test_out_of_range_numbers_are_refused_naming_the_param_and_bound(name, value, bound, which):
    from airflow.sdk.definitions.param import ParamsDict
    from airflow.sdk.exceptions import ParamValidationError

    params = ParamsDict(knobs.lifecycle_params())
    side = "less than the minimum" if which == "minimum" else "greater than the maximum"
    bound_text = re.escape(repr(bound))
    with pytest.raises(ParamValidationError, match=rf"param {name}: .* is {side} of {bound_text}\b"):
        params[name] = value


def bad_values(param) -> list:
    """Values the Param's own schema refuses: wrong types, bad enums and patterns."""
    kinds = types_of(param)
    out: list = []
    wrong = {"integer": "seven", "number": "0.1x", "boolean": "yes", "array": "a.jsonl",
             "object": [1], "string": 7}
    out += [wrong[k] for k in kinds if k in wrong]
    if "integer" in kinds:
        out.append(2.5)
    if param.schema.get("enum"):
        out.append("no-such-choice")
    if param.schema.get("pattern"):
        out.append("Not Valid!")
    if "array" in kinds and param.schema.get("items", {}).get("type") == "string":
        out.append([""])
    if "object" in kinds and param.schema.get("additionalProperties") is False:
        out.append({"pretraining": {}})
    return out


CASES = [(n, v) for n, p in knobs.lifecycle_params().items() for v in bad_values(p)]


@pytest.mark.parametrize("name, value", CASES, ids=[f"{n}={v!r}" for n, v in CASES])
def test_schema_generated_bad_values_are_refused_by_the_form(name, value):
    from airflow.sdk.definitions.param import ParamsDict
    from airflow.sdk.exceptions import ParamValidationError

    params = ParamsDict(knobs.lifecycle_params())
    with pytest.raises(ParamValidationError, match=rf"param {name}\b"):
        params[name] = value
