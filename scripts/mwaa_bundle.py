"""Write what Amazon MWAA takes into dist/mwaa/ (`make mwaa-bundle`).

    dist/mwaa/dags/            the DAG files: upload to the environment's DAGs folder in S3
    dist/mwaa/plugins.zip      llmops (the Airflow side) + tasks/__init__.py + tasks/configs/
    dist/mwaa/requirements.txt requirements.txt behind MWAA's Airflow 3.3.1 constraints line
    dist/mwaa/startup.sh       the environment variables the Airflow side reads
    dist/mwaa/airflow_configuration_options.json
                               the environment's Airflow configuration options (the
                               AirflowConfigurationOptions of CreateEnvironment/UpdateEnvironment,
                               `airflow_configuration_options` in Terraform): deferral on, so a
                               task waiting on a remote job frees its worker slot for the triggerer,
                               and workers' API calls retried through an API server restart

MWAA unpacks plugins.zip into its plugins folder, which is on every component's sys.path, so
`import llmops` and `import tasks.configs` work as they do locally. tasks/ is the job side: only
the modules the Airflow side imports travel (tasks/configs/ and what the DAGs and plugins name,
found by reading their imports), and each must need nothing but the standard library, since
torch, ray and numpy never reach the workers. A module that does fails the build, naming it.
"""

from __future__ import annotations

import argparse
import ast
import json
import shutil
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AIRFLOW_VERSION = "3.3.1"
PYTHON_VERSION = "3.12"   # MWAA 3.3.1's Python
CONSTRAINTS_URL = (f"https://raw.githubusercontent.com/apache/airflow/constraints-{AIRFLOW_VERSION}/"
                   f"constraints-{PYTHON_VERSION}.txt")
TASKS_ALWAYS = ("tasks.configs",)   # the typed stage configs the Params are generated from
PLUGIN_DATA = (".json",)  # the CRD schemas the hyperpod backend validates against

STARTUP = """#!/bin/sh
# MWAA runs this on every scheduler, worker and web server before Airflow starts.
# MLflow: a tracking server every worker and every job can reach (an MLflow server URL, or a
# SageMaker managed MLflow ARN, which needs `sagemaker-mlflow` in requirements.txt). Never a
# local file: MWAA workers do not share a disk.
export MLFLOW_TRACKING_URI="{tracking_uri}"
# Where stage outputs go: an s3:// prefix the jobs' IAM roles can write.
export LLMOPS_STORAGE_ROOT="{storage_root}"
# Scratch space of the Airflow side (job records of the local backend, not used by remote jobs).
export LLMOPS_HOME="/usr/local/airflow/llmops"
if [ -z "$MLFLOW_TRACKING_URI" ] || [ -z "$LLMOPS_STORAGE_ROOT" ]; then
  echo "llmops: set MLFLOW_TRACKING_URI and LLMOPS_STORAGE_ROOT in startup.sh ({hint})" >&2
fi
"""
# What startup.sh and the build's warnings tell a user to run: the variables the Makefile's
# mwaa-bundle target reads (not MLFLOW_TRACKING_URI: the Makefile sets that to the local store).
HINT = "make mwaa-bundle MWAA_TRACKING_URI=... STORAGE_ROOT=s3://..."
# Tracking URIs no MWAA worker can share (each has its own disk): refused at build time.
LOCAL_TRACKING = ("sqlite:", "file:", "./", "/")


# A worker's calls to the API server (its heartbeat, its XCom push, its final state) retried
# through an API server restart (an MWAA update or maintenance window): Airflow's default, 5
# tries with random exponential waits, gives up within ~30 s. In the fault matrix a restart on a
# loaded machine took 93 s, and tasks whose jobs had succeeded failed pushing their result.
# 12 tries with waits up to 60 s outlast ~4 minutes of restart.
EXECUTION_API_RETRIES = {
    "workers.execution_api_retries": "12",
    "workers.execution_api_retry_wait_max": "60",
}
# MWAA takes string values only. operators.default_deferrable: every deferrable operator (ours,
# the provider's) waits in the triggerer instead of holding a worker for days of pretraining.
AIRFLOW_CONFIGURATION_OPTIONS = {
    "operators.default_deferrable": "True",
    **EXECUTION_API_RETRIES,
}


class BundleError(RuntimeError):
    """The Airflow side needs something MWAA workers will not have."""


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (lazy imports inside functions included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _module_file(module: str) -> Path | None:
    path = ROOT.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def tasks_modules() -> list[str]:
    """The tasks/ files the DAGs and plugins import, with their packages' __init__ files."""
    sources = [*(ROOT / "dags").glob("*.py"), *(ROOT / "plugins").rglob("*.py")]
    todo = set(TASKS_ALWAYS) | {m for src in sources for m in _imports(src) if m.split(".")[0] == "tasks"}
    files: dict[str, Path] = {}
    while todo:
        module = todo.pop()
        path = _module_file(module)
        if path is None or module in files:
            continue
        files[module] = path
        for name in _imports(path):
            top = name.split(".")[0]
            if top == "tasks":
                todo.add(name)
            elif top not in sys.stdlib_module_names and top != "__future__":
                raise BundleError(
                    f"The Airflow side imports {module} ({path.relative_to(ROOT)}), which imports "
                    f"{name}: MWAA workers only have requirements.txt. Move what the Airflow side "
                    f"needs into a standard-library-only module, or import it inside the job.")
        parts = module.split(".")
        todo.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return sorted({path.relative_to(ROOT).as_posix() for path in files.values()})


def plugin_files() -> list[tuple[Path, str]]:
    files = []
    for path in sorted((ROOT / "plugins").rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and (
                path.suffix == ".py" or path.suffix in PLUGIN_DATA
                or path.name == ".airflowignore"):  # keeps the library out of plugin scanning
            files.append((path, path.relative_to(ROOT / "plugins").as_posix()))
    return files + [(ROOT / name, name) for name in tasks_modules()]


def requirements() -> str:
    lines = [f'--constraint "{CONSTRAINTS_URL}"']
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        requirement = line.split("#", 1)[0].strip()
        if requirement:
            lines.append(requirement)
    return "\n".join(lines) + "\n"


def check_settings(tracking_uri: str, storage_root: str) -> list[str]:
    """Warnings about what startup.sh will export: an empty tracking URI or storage root (the
    jobs would log nowhere, or write beside a worker's scratch). A local tracking store is
    refused (BundleError): MWAA workers share no disk."""
    if tracking_uri.startswith(LOCAL_TRACKING) or (tracking_uri and "://" not in tracking_uri
                                                   and not tracking_uri.startswith("arn:")):
        raise BundleError(f"MWAA_TRACKING_URI={tracking_uri!r} is a local store, which MWAA's "
                          f"workers do not share: give an MLflow server URL (https://...) or a "
                          f"SageMaker managed MLflow ARN ({HINT}).")
    warnings = []
    if not tracking_uri:
        warnings.append(f"no tracking URI: startup.sh exports MLFLOW_TRACKING_URI=\"\" and nothing "
                        f"will reach MLflow. Build with {HINT}")
    if not storage_root:
        warnings.append(f"no storage root: startup.sh exports LLMOPS_STORAGE_ROOT=\"\". Build with {HINT}")
    elif not storage_root.startswith("s3://"):
        warnings.append(f"STORAGE_ROOT={storage_root!r} is not an s3:// prefix: MWAA workers and "
                        f"remote jobs share no local disk")
    return warnings


def build(out: Path, tracking_uri: str = "", storage_root: str = "") -> Path:
    check_settings(tracking_uri, storage_root)
    if out.exists():
        shutil.rmtree(out)
    (out / "dags").mkdir(parents=True)
    for dag in sorted((ROOT / "dags").glob("*.py")):
        shutil.copy2(dag, out / "dags" / dag.name)
    with zipfile.ZipFile(out / "plugins.zip", "w", zipfile.ZIP_DEFLATED) as zf:
        for path, name in plugin_files():
            # A fixed timestamp: the same sources give the same zip, and MWAA sees no change.
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, path.read_bytes())
    (out / "requirements.txt").write_text(requirements())
    startup = out / "startup.sh"
    startup.write_text(STARTUP.format(tracking_uri=tracking_uri, storage_root=storage_root, hint=HINT))
    startup.chmod(0o755)
    (out / "airflow_configuration_options.json").write_text(
        json.dumps(AIRFLOW_CONFIGURATION_OPTIONS, indent=2, sort_keys=True) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "dist" / "mwaa"))
    parser.add_argument("--tracking-uri", default="", help="MLFLOW_TRACKING_URI for startup.sh")
    parser.add_argument("--storage-root", default="", help="LLMOPS_STORAGE_ROOT (s3://...) for startup.sh")
    args = parser.parse_args()
    try:
        warnings = check_settings(args.tracking_uri, args.storage_root)
        out = build(Path(args.out), args.tracking_uri, args.storage_root)
    except BundleError as exc:
        raise SystemExit(f"make mwaa-bundle: {exc}") from None
    for warning in warnings:
        print(f"WARNING: {warning}", file=sys.stderr)
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        print(f"{path.relative_to(out.parent)}  {path.stat().st_size:>9,d} bytes")
    print("Upload: aws s3 sync dist/mwaa/dags s3://<bucket>/dags; aws s3 cp dist/mwaa/plugins.zip "
          "dist/mwaa/requirements.txt dist/mwaa/startup.sh s3://<bucket>/, then point the "
          "environment at their new object versions and set its Airflow configuration options "
          "from dist/mwaa/airflow_configuration_options.json (aws mwaa update-environment "
          "--name <env> --airflow-configuration-options file://dist/mwaa/"
          "airflow_configuration_options.json).")


if __name__ == "__main__":
    main()
