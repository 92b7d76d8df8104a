"""Which environment values are secrets, for every backend and the operator alike.

A value is secret when its name looks secret (PASSWORD, SECRET, TOKEN, ACCESS_KEY, ...) or when it is the password of a URI with credentials
(`postgres://user:pw@host/db`, an `AIRFLOW_CONN_*` connection). Remote backends refuse such
entries in a job's env (`check_remote_env`); JobOperator and JobTrigger register their values
with Airflow's secrets masker (`mask_in_task_logs`) and pass the job's log lines through it
(`redact_lines`), so a job that prints one shows `***` in the task log.
"""

from __future__ import annotations

import re
from typing import Mapping
from urllib.parse import unquote

# Whole words of a variable name: HF_TOKEN and AWS_SECRET_ACCESS_KEY, not TOKENIZERS_PARALLELISM.
SECRET_NAME = re.compile(r"(^|_)(PASSWORD|PASSWD|SECRET|TOKEN|CREDENTIALS?|PRIVATE_KEY|ACCESS_KEY|"
                         r"API_KEY)(_|$)", re.IGNORECASE)
URI_USERINFO = re.compile(r"^[a-z][a-z0-9+.-]*://[^/@\s]*:[^/@\s]*@", re.IGNORECASE)
# Flags beside a secret (HF_HUB_DISABLE_TOKEN=true): masked, every "true" in the logs would go.
NOT_SECRET_VALUES = frozenset({"true", "false", "yes", "no", "none", "null", "0", "1"})
# What boto3 reads as static credentials: a remote job must get its own from its IAM role.
AWS_CREDENTIAL_NAMES = frozenset({"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                                  "AWS_SECURITY_TOKEN"})


def uri_password(value: str) -> str:
    """The password of `scheme://user:password@host...`, as written (percent-encoded), or ''."""
    if not URI_USERINFO.match(value):
        return ""
    userinfo = value.split("://", 1)[1].split("@", 1)[0]
    return userinfo.split(":", 1)[1]


def secret_values(env: Mapping[str, str]) -> list[str]:
    """Every secret value in `env`: secret-looking names' values and URI passwords, each also
    percent-decoded (how a connection hands its password to the code that uses it)."""
    found: set[str] = set()
    for name, value in env.items():
        if not value:
            continue
        if SECRET_NAME.search(name) and value.lower() not in NOT_SECRET_VALUES:
            found.add(value)
        password = uri_password(value)
        if password:
            found.update({password, unquote(password)})
    return sorted(found)


def check_remote_env(env: Mapping[str, str]) -> None:
    """Refuse credentials in a remote job's env: its request is readable by describe calls."""
    from llmops.jobs.spec import JobSpecError

    for key, value in env.items():
        if key.upper() in AWS_CREDENTIAL_NAMES:
            raise JobSpecError(
                f"JobSpec.env[{key!r}] is an AWS credential. Remote jobs get their credentials from "
                "their IAM role (the backend's role_arn setting), never from the environment: "
                f"remove {key} from the env and grant the role what the job needs.")
        if SECRET_NAME.search(key):
            raise JobSpecError(
                f"JobSpec.env[{key!r}] looks like a secret. A remote job's environment is visible in "
                "its API description: give the job an IAM role (or read the secret from AWS Secrets "
                "Manager inside the job) instead of passing it in the environment.")
        if URI_USERINFO.match(value):
            raise JobSpecError(f"JobSpec.env[{key!r}] holds a URI with a password; use a URI without "
                               "credentials and grant the job access through its IAM role.")


def mask_in_task_logs(*envs: Mapping[str, str]) -> int:
    """Register every secret value of `envs` with Airflow's secrets masker, in this process and
    its supervisor, so task log lines (a job's output streamed in) show `***` instead. Returns how
    many values were registered."""
    from airflow.sdk.log import mask_secret  # Task SDK; imported at use, not at DAG parse

    values = _all_secret_values(envs)
    for value in values:
        mask_secret(value)
    return len(values)


async def amask_in_task_logs(*envs: Mapping[str, str]) -> int:
    """`mask_in_task_logs` for a trigger: the blocking send to the supervisor could deadlock
    the triggerer's event loop."""
    from airflow.sdk.log import amask_secret

    values = _all_secret_values(envs)
    for value in values:
        await amask_secret(value)
    return len(values)


def redact_lines(lines: list[str]) -> list[str]:
    """A job's log lines with every registered secret as `***`. Task log handlers mask too, but
    only where Airflow configured them (a supervised worker, not `airflow dags test`): the job's
    output is masked here, wherever the task runs."""
    from airflow.sdk.log import redact

    return [redact(line) for line in lines]


def _all_secret_values(envs: tuple[Mapping[str, str], ...]) -> set[str]:
    return {value for env in envs for value in secret_values(env)}


def redact_uri(uri: str) -> str:
    return URI_USERINFO.sub(lambda m: m.group(0).split("://")[0] + "://***@", uri)
