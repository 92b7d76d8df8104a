"""Alerts: a message to the deployment's SNS topic, e-mail and/or Slack when something needs a person.

Where to send is a deployment setting, in the `[llmops]` section of Airflow's config (or its
environment form `AIRFLOW__LLMOPS__<KEY>`, an MWAA configuration option `llmops.<key>`):

  notify_sns_topic_arn   the topic to publish to (the amazon provider's SnsNotifier). Unset or
                         blank: no alert is sent and nothing is logged as an error.
  notify_aws_conn_id     the Airflow connection it publishes with (default: $LLMOPS_AWS_CONN_ID,
                         else aws_default).
  notify_email_to        comma-separated addresses to e-mail the same alert to (the smtp
                         provider's SmtpNotifier). Unset or blank: no e-mail.
  notify_smtp_conn_id    the SMTP connection it sends with (default smtp_default: host, port,
                         login, and the sender in its extra `from_email`; Amazon SES's SMTP
                         endpoint works as any other).
  notify_slack_conn_id   the Slack Incoming Webhook connection (conn type `slackwebhook`; the
                         webhook URL, a secret, lives only there) to post the same alert to (the
                         slack provider's SlackWebhookNotifier). Unset or blank: nothing to Slack.
  notify_queue_seconds   a job still queued for capacity this long after its submission is
                         alerted on once (default 3600; 0 turns that alert off).
  notify_plateau_evals   a job whose validation loss made no new best for this many evaluations
                         in a row is alerted on once (default 5; 0 turns that alert off).

What fires: a stage task's final failure (`stage_failed`, the on_failure_callback of the
lifecycle and retrain DAGs: not on a retry), and inside a running job a guard rollback, a capacity
wait past notify_queue_seconds, a stalled worker and a loss plateau (llmops.jobs.alerts). Sending never raises:
an alert that cannot be sent is logged as a warning and the task or watch goes on. Each message
goes through Airflow's secrets masker first, so a masked value shows as ***.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Callable

log = logging.getLogger(__name__)

SECTION = "llmops"
TOPIC_SETTING = "notify_sns_topic_arn"
CONN_SETTING = "notify_aws_conn_id"
QUEUE_SETTING = "notify_queue_seconds"
DEFAULT_QUEUE_SECONDS = 3600.0
PLATEAU_SETTING = "notify_plateau_evals"
DEFAULT_PLATEAU_EVALS = 5
EMAIL_SETTING = "notify_email_to"
SMTP_CONN_SETTING = "notify_smtp_conn_id"
DEFAULT_SMTP_CONN_ID = "smtp_default"
SLACK_SETTING = "notify_slack_conn_id"
# Airflow's own rule for a connection id (airflow.models.connection.RE_SANITIZE_CONN_ID, 250 at most)
CONN_ID = re.compile(r"^[\w#!()\-.:/\\]{1,250}$")
ADDRESS = re.compile(r"^[^@\s,;<>]+@[^@\s,;<>]+\.[^@\s,;<>]+$")
SUBJECT_MAX = 100   # SNS refuses a longer Subject
# arn:<partition>:sns:<region>:<account>:<topic name> (a FIFO topic's name ends in .fifo)
TOPIC_ARN = re.compile(r"^arn:aws[a-z-]*:sns:[a-z]{2}(-[a-z]+)+-\d:\d{12}:[A-Za-z0-9_-]{1,256}(\.fifo)?$")


class NotifySettingsError(ValueError):
    """A notification setting is malformed; the message names the setting."""


def _setting(key: str) -> str:
    try:
        from airflow.sdk import conf

        value = conf.get(SECTION, key, fallback=None)
    except Exception:  # noqa: BLE001 - no Airflow config here: its environment form only
        value = None
    if value is None:
        value = os.environ.get(f"AIRFLOW__{SECTION.upper()}__{key.upper()}")
    return str(value or "").strip()


def topic_arn() -> str:
    """The configured topic's ARN, "" when none is; NotifySettingsError when it is malformed."""
    arn = _setting(TOPIC_SETTING)
    if arn and not TOPIC_ARN.match(arn):
        raise NotifySettingsError(
            f"[{SECTION}] {TOPIC_SETTING} is not an SNS topic ARN: {arn!r} (expected "
            f"arn:aws:sns:<region>:<12-digit account>:<topic name>).")
    return arn


def queue_seconds() -> float | None:
    """notify_queue_seconds: None when the capacity-wait alert is off."""
    text = _setting(QUEUE_SETTING)
    if not text:
        return DEFAULT_QUEUE_SECONDS
    try:
        value = float(text)
    except ValueError:
        raise NotifySettingsError(f"[{SECTION}] {QUEUE_SETTING} must be a number of seconds "
                                  f"(0 turns the alert off), not {text!r}.") from None
    if value < 0:
        raise NotifySettingsError(f"[{SECTION}] {QUEUE_SETTING} must be >= 0, not {text!r}.")
    return value or None


def plateau_evals() -> int | None:
    """notify_plateau_evals: None when the plateau alert is off."""
    text = _setting(PLATEAU_SETTING)
    if not text:
        return DEFAULT_PLATEAU_EVALS
    if not text.isdigit():
        raise NotifySettingsError(f"[{SECTION}] {PLATEAU_SETTING} must be a whole number of "
                                  f"evaluations (0 turns the alert off), not {text!r}.")
    return int(text) or None


def email_to() -> list[str]:
    """notify_email_to's addresses, [] when unset; NotifySettingsError naming a malformed one."""
    addresses = [a.strip() for a in _setting(EMAIL_SETTING).split(",") if a.strip()]
    bad = [a for a in addresses if not ADDRESS.match(a)]
    if bad:
        raise NotifySettingsError(f"[{SECTION}] {EMAIL_SETTING} has malformed address(es) {bad}: "
                                  "write name@example.com, several separated by commas.")
    return addresses


def slack_conn_id() -> str:
    """notify_slack_conn_id, "" when unset; NotifySettingsError when it is no Airflow connection id
    (a webhook URL pasted there is refused without being repeated: it is a secret)."""
    conn_id = _setting(SLACK_SETTING)
    if "://" in conn_id:
        raise NotifySettingsError(f"[{SECTION}] {SLACK_SETTING} must name an Airflow connection, not "
                                  "hold a URL: put the webhook URL in that connection's password.")
    if conn_id and not CONN_ID.match(conn_id):
        raise NotifySettingsError(f"[{SECTION}] {SLACK_SETTING} is not an Airflow connection id: "
                                  f"{conn_id!r} (letters, digits and _-.:/\\#!() only).")
    return conn_id


def configured() -> bool:
    """Whether alerts go anywhere (a malformed setting counts: sending then says what is wrong)."""
    return any(_setting(key) for key in (TOPIC_SETTING, EMAIL_SETTING, SLACK_SETTING))


def send(subject: str, message: str, context: Any = None) -> bool:
    """Send one alert to every configured channel; True when one took it. Never raises: nothing
    configured sends nothing, and a failure (a malformed setting, AWS, the mail server or Slack
    refusing) is logged as a warning; one channel failing never keeps the alert from the others."""
    subject, message = _subject(_redact(subject)), _redact(message)
    sent = False
    for targets, deliver in ((topic_arn, _publish), (email_to, _email), (slack_conn_id, _slack)):
        try:
            where = targets()
        except NotifySettingsError as exc:
            log.warning("Alert not sent: %s", exc)
            continue
        if not where:
            continue
        try:
            said = deliver(where, subject, message, context or {})
        except Exception as exc:  # noqa: BLE001 - an alert must never fail what it reports on
            log.warning("Could not send the alert %r to %s: %s: %s", subject, where,
                        type(exc).__name__, exc)
            continue
        log.info("Alert sent to %s: %s", said, subject)
        sent = True
    return sent


def _publish(arn: str, subject: str, message: str, context: Any) -> str:
    from airflow.providers.amazon.aws.notifications.sns import SnsNotifier

    from llmops.core.settings import aws_conn_id

    SnsNotifier(aws_conn_id=_setting(CONN_SETTING) or aws_conn_id(), target_arn=arn, subject=subject,
                message=message, region_name=arn.split(":")[3]).notify(context)
    return arn


def _email(to: list[str], subject: str, message: str, context: Any) -> str:
    import html

    from airflow.providers.smtp.notifications.smtp import SmtpNotifier

    conn_id = _setting(SMTP_CONN_SETTING) or DEFAULT_SMTP_CONN_ID
    # notify() sends the fields as given: no Jinja rendering of the message's own text
    SmtpNotifier(to=to, subject=subject, smtp_conn_id=conn_id, mime_subtype="alternative",
                 html_content=f"<pre>{html.escape(message)}</pre>").notify(context)
    return f"{', '.join(to)} (connection {conn_id})"


def _slack(conn_id: str, subject: str, message: str, context: Any) -> str:
    from airflow.providers.slack.notifications.slack_webhook import SlackWebhookNotifier

    # mrkdwn: the subject in bold; &, < and > escaped, so a reason cannot @-mention or link
    escape = lambda text: text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")  # noqa: E731
    SlackWebhookNotifier(slack_webhook_conn_id=conn_id, text=f"*{escape(subject)}*\n{escape(message)}",
                         unfurl_links=False, unfurl_media=False).notify(context)
    return f"Slack (connection {conn_id})"


def stage_failed(context: Any, sender: Callable[[str, str, Any], bool] | None = None) -> bool:
    """The on_failure_callback of every stage task: one message naming the DAG, the run, the
    task, the first line of why it failed, and where its log and the run's page are. Airflow calls
    it on the final failure only (a retry calls on_retry_callback)."""
    try:
        subject, message = stage_failure_message(context)
    except Exception as exc:  # noqa: BLE001 - a callback must not hide the failure itself
        log.warning("Could not describe the failure for an alert: %s: %s", type(exc).__name__, exc)
        return False
    return (sender or send)(subject, message, context)


def stage_failure_message(context: Any) -> tuple[str, str]:
    ti = context.get("ti") or context.get("task_instance")
    dag_id = getattr(ti, "dag_id", None) or getattr(context.get("dag"), "dag_id", "?")
    run_id = getattr(ti, "run_id", None) or context.get("run_id") or "?"
    task_id = getattr(ti, "task_id", None) or "?"
    map_index = getattr(ti, "map_index", -1)
    task = task_id if map_index is None or map_index < 0 else f"{task_id}[{map_index}]"
    exc = context.get("exception")
    reason = first_line(str(exc) if exc is not None else "") or (
        type(exc).__name__ if exc is not None else "no reason given (see the task log)")
    lines = [f"Stage {task} failed in DAG {dag_id}, run {run_id}.",
             f"Reason: {reason}"]
    log_url = _log_url(ti)
    if log_url:
        lines.append(f"Task log: {log_url}")
    lines.append(f"Run page: {run_url(dag_id, run_id)}")
    try_number = getattr(ti, "try_number", None)
    if try_number:
        lines.append(f"Try {try_number}: the task will not be retried.")
    return f"[llmops] {dag_id}: {task} failed", "\n".join(lines)


def run_url(dag_id: str, run_id: str) -> str:
    from llmops.infra.tracking import airflow_run_url

    return airflow_run_url(dag_id, run_id)


def first_line(text: str) -> str:
    return next((line.strip() for line in str(text).splitlines() if line.strip()), "")


def _log_url(ti: Any) -> str:
    try:
        return str(getattr(ti, "log_url", "") or "")
    except Exception:  # noqa: BLE001 - the run page still says where
        return ""


def _subject(text: str) -> str:
    # SNS: ASCII printable, no line breaks, at most 100 characters
    text = "".join(c if 32 <= ord(c) < 127 else "?" for c in first_line(text))
    return text if len(text) <= SUBJECT_MAX else text[: SUBJECT_MAX - 3] + "..."


def _redact(text: str) -> str:
    try:
        from airflow.sdk.log import redact

        return str(redact(text))
    except Exception:  # noqa: BLE001 - outside Airflow: nothing is registered to mask
        return text
