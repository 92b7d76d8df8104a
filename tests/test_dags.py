"""DAG integrity and Params: every DAG imports cleanly without touching a database, the network
or heavy libraries, and bad Params are refused, naming the Param, before any job starts."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmops.policy.params import KNOBS, field_of, knob_schema, lifecycle_params, schema_bounds
from llmops.stages import lifecycle
from tasks import configs

ROOT = Path(__file__).resolve().parents[1]

PARSE_SCRIPT = r"""
import json, socket, sys
def refuse(*args, **kwargs):
    raise RuntimeError("a DAG file opened a network connection while being parsed")
socket.socket.connect = refuse
socket.create_connection = refuse
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=sys.argv[1])
print(json.dumps({
    "errors": {k: str(v) for k, v in bag.import_errors.items()},
    "dags": sorted(bag.dag_ids),
    "heavy": sorted(m for m in ("torch", "ray", "mlflow", "tokenizers", "numpy") if m in sys.modules),
}))
"""


def test_every_dag_imports_without_db_network_or_heavy_libraries(tmp_path):
    env = {**os.environ,
           # Any metadata-DB query at parse time would fail on this unreachable database.
           "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{tmp_path}/missing/dir/airflow.db",
           "AIRFLOW_HOME": str(tmp_path / "airflow")}
    proc = subprocess.run([sys.executable, "-c", PARSE_SCRIPT, str(ROOT / "dags")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["errors"] == {}
    assert "llm_lifecycle" in report["dags"]
    assert report["heavy"] == [], "DAG parsing must not import torch, ray, mlflow or numpy"


def test_lifecycle_dag_shape():
    from airflow.dag_processing.dagbag import DagBag

    dag = DagBag(dag_folder=str(ROOT / "dags")).dags["llm_lifecycle"]
    order = ["start_run", "data_prep", "plan_trials", "sweep_trial", "pick_best", "pretrain",
             "finetune", "distill", "evaluate", "promote"]
    assert sorted(t.task_id for t in dag.tasks) == sorted(order)
    for upstream, downstream in zip(order, order[1:]):
        assert downstream in dag.get_task(upstream).get_direct_relative_ids(upstream=False) or \
            upstream in dag.get_task(downstream).get_flat_relative_ids(upstream=True)
    assert dag.max_active_runs == 1 and dag.schedule is None or dag.timetable.summary == "None"


def test_dags_run_only_when_triggered_start_unpaused_and_scheduled_ones_do_not():
    """Paused, a run triggered from the CLI or REST waits in 'queued' for ever (only the UI's form
    unpauses); unpaused, a scheduled DAG would start runs on its own as soon as it is deployed."""
    from airflow.dag_processing.dagbag import DagBag

    dags = DagBag(dag_folder=str(ROOT / "dags")).dags
    triggered = sorted(d for d, dag in dags.items() if dag.schedule is None)
    assert triggered == ["llm_lifecycle", "llm_replay", "scaling_ladder"]
    for dag_id, dag in dags.items():
        # None: Airflow's [core] dags_are_paused_at_creation (True by default) decides
        assert dag.is_paused_upon_creation is (False if dag_id in triggered else None), dag_id


def test_every_param_is_generated_from_a_config_field_with_its_bounds():
    params = lifecycle_params()
    for name, path in KNOBS.items():
        field, _ = field_of(path)
        schema, expected = params[name].schema, knob_schema(path)
        assert params[name].description == expected.pop("description")
        assert schema == expected
        lo, hi = schema_bounds(schema)  # in allOf: at the top the form's number field clamps
        if field.metadata.get("minimum") is not None:
            assert lo == field.metadata["minimum"]
        if field.metadata.get("maximum") is not None:
            assert hi == field.metadata["maximum"]
    assert params["recipe"].value == "demo"
    assert set(params["backend_pretrain"].schema["enum"]) >= {"local"}


@pytest.mark.parametrize("name", ["tiny", "demo", "gpu"])
def test_every_recipe_resolves_and_validates(name):
    cfg = lifecycle.resolve({"recipe": name})
    assert cfg.pretrain.model.vocab_size == cfg.data.vocab_size
    assert cfg.distill.student.approx_params < cfg.pretrain.model.approx_params


@pytest.mark.parametrize("params, message", [
    ({"n_embd": 100, "n_head": 3}, "n_embd (100) must be a multiple of n_head (3)"),
    ({"lr_min": 0.1, "lr_max": 0.01}, "lr_min (0.1) must be <= lr_max (0.01)"),
    ({"data_inputs": ["/nonexistent/corpus-*.jsonl"]}, "matches no file"),
    ({"recipe": "huge"}, "Unknown recipe 'huge'"),
])
def test_cross_field_mistakes_are_refused_with_the_field_named(params, message):
    with pytest.raises(lifecycle.LifecycleParamError, match=message.replace("(", r"\(").replace(")", r"\)")):
        lifecycle.resolve(params)


def test_param_schema_refuses_out_of_range_values_in_the_trigger_form():
    from airflow.sdk.definitions.param import ParamsDict
    from airflow.sdk.exceptions import ParamValidationError

    params = ParamsDict(lifecycle_params())
    params["n_layer"] = 4
    params.validate()
    with pytest.raises(ParamValidationError, match="n_layer: 0 is less than the minimum of 1"):
        params["n_layer"] = 0
    with pytest.raises(ParamValidationError, match="backend_pretrain"):
        params["backend_pretrain"] = "my-laptop"


def test_bad_conf_fails_the_run_before_any_job_starts(airflow_db):
    from tests.isolated_env import airflow_cli

    jobs = Path(os.environ["LLMOPS_HOME"], "jobs")
    before = set(jobs.iterdir()) if jobs.exists() else set()
    proc = airflow_cli("dags", "test", "llm_lifecycle", "-c",
                       json.dumps({"recipe": "tiny", "n_embd": 30, "n_head": 4}))
    output = proc.stdout + proc.stderr
    assert "n_embd (30) must be a multiple of n_head (4)" in output
    after = set(jobs.iterdir()) if jobs.exists() else set()
    assert after == before, "no job may start when the Params are invalid"


def test_stage_configs_refuse_unknown_keys_naming_them():
    with pytest.raises(configs.ConfigError, match=r"Unknown config key\(s\) in TrainConfig: \['max_stpes'\]"):
        configs.from_dict(configs.TrainConfig, {"data_dir": "d", "output_dir": "o", "max_stpes": 5})
    with pytest.raises(configs.ConfigError, match="TrainConfig.model.n_layer must be int"):
        configs.from_dict(configs.TrainConfig, {"data_dir": "d", "output_dir": "o",
                                                "model": {"n_layer": "2"}})
    assert dataclasses.is_dataclass(configs.recipe("tiny").pretrain)


def test_plugins_folder_registers_our_plugin_without_shadowing_real_packages():
    """Airflow imports each scanned plugins-folder file as sys.modules[<file stem>]; the llmops
    library (ray.py, settings.py, sagemaker.py...) must stay out of that scan or it replaces the
    real `ray` in every Airflow process (this once broke Ray data prep in the same process)."""
    script = r"""
import json, sys
from airflow._shared.plugins_manager.plugins_manager import _load_plugins_from_plugin_directory
plugins, errors = _load_plugins_from_plugin_directory(sys.argv[1])
print(json.dumps({"plugins": [p.name for p in plugins], "errors": errors,
                  "shadowed": sorted(n for n in ("ray", "settings", "sagemaker", "local", "spec",
                                                 "tracking", "params") if n in sys.modules)}))
"""
    proc = subprocess.run([sys.executable, "-c", script, str(ROOT / "plugins")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == {"plugins": ["llmops_sweep_pool", "llmops_run_page", "llmops_pause"], "errors": {},
                      "shadowed": []}
