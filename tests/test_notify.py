"""Alerts (llmops.infra.notify, llmops.jobs.alerts) against a local SNS: moto's, read back through
an SQS queue subscribed to the topic, so each test reads the subject and text a person would get;
and the same through a local SMTP server (e-mail) and a local HTTP server standing in for Slack's
webhook."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

import pytest

import llmops.airflow.triggers.job_trigger as job_trigger
from llmops.infra import notify
from llmops.jobs.alerts import ALERTS_FILE, JobAlerts
from llmops.jobs.backends import JobState, JobStatus
from llmops.jobs.watch import JobWatch
from tests.aws_fixtures import CONN_ID, REGION
from tests.test_wait_faults import ScriptedBackend

ROLLBACK_LINE = ("2026-12-04 03:10:00,000 INFO tasks.train.telemetry: [worker rank 0] rollback "
                 "from_step=120 to_step=100 anomaly=spike path=s3://b/ckpt/step-100")
STALL_LINE = ("2026-12-04 03:20:00,000 ERROR tasks.train.supervisor: [supervisor rank 0] no progress "
              "from worker 4242 for 612.3s (step 130, forward, budget 600s); dumping its stacks")
CAPACITY = "RUNNABLE CAPACITY:INSUFFICIENT_INSTANCE_CAPACITY - Service cannot fulfill the capacity"


class FailingTI:
    dag_id, run_id, task_id, map_index, try_number = "llm_lifecycle", "manual__2026-12-04", "pretrain", -1, 2
    log_url = "http://airflow.example/dags/llm_lifecycle/runs/manual__2026-12-04/tasks/pretrain?try_number=2"


@pytest.fixture
def topic(moto_server, monkeypatch):  # the session's moto server (tests.isolated_env)
    """A topic on moto's SNS with an SQS queue subscribed; returns a function that reads what was
    published to it since the last call, as (subject, message) pairs."""
    sns, sqs = moto_server.client("sns"), moto_server.client("sqs")
    name = f"llmops-alerts-{uuid.uuid4().hex[:8]}"   # one per test: nothing left from another
    arn = sns.create_topic(Name=name)["TopicArn"]
    queue = sqs.create_queue(QueueName=f"{name}-inbox")["QueueUrl"]
    queue_arn = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    sub = sns.subscribe(TopicArn=arn, Protocol="sqs", Endpoint=queue_arn)["SubscriptionArn"]
    monkeypatch.setenv("AIRFLOW__LLMOPS__NOTIFY_SNS_TOPIC_ARN", arn)
    monkeypatch.setenv("AIRFLOW__LLMOPS__NOTIFY_AWS_CONN_ID", CONN_ID)

    def published() -> list[tuple[str, str]]:
        got = []
        while True:
            batch = sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=10,
                                        WaitTimeSeconds=0).get("Messages", [])
            if not batch:
                return got
            for m in batch:
                body = json.loads(m["Body"])
                got.append((body.get("Subject"), body["Message"]))
                sqs.delete_message(QueueUrl=queue, ReceiptHandle=m["ReceiptHandle"])

    published.arn = arn
    yield published
    sns.unsubscribe(SubscriptionArn=sub)
    sns.delete_topic(TopicArn=arn)
    sqs.delete_queue(QueueUrl=queue)


def test_a_stage_failure_sends_one_message_a_person_can_act_on(topic):
    error = RuntimeError("pretrain job pretrain-7f3a failed: the job exited with code 5.\n"
                         "Last lines of its log:\nTraceback ...")
    assert notify.stage_failed({"ti": FailingTI(), "exception": error}) is True
    [(subject, message)] = topic()
    assert subject == "[llmops] llm_lifecycle: pretrain failed"
    assert message.splitlines() == [
        "Stage pretrain failed in DAG llm_lifecycle, run manual__2026-12-04.",
        "Reason: pretrain job pretrain-7f3a failed: the job exited with code 5.",
        f"Task log: {FailingTI.log_url}",
        "Run page: " + notify.run_url("llm_lifecycle", "manual__2026-12-04"),
        "Try 2: the task will not be retried."]
    assert "Traceback" not in message   # the first line of the reason only


def test_a_masked_secret_never_reaches_the_message(topic):
    from airflow.sdk.log import mask_secret

    mask_secret("hunter2-very-secret")
    error = RuntimeError("could not log in with password hunter2-very-secret")
    assert notify.stage_failed({"ti": FailingTI(), "exception": error})
    [(_, message)] = topic()
    assert "hunter2-very-secret" not in message and "***" in message


def test_nothing_configured_sends_nothing_and_logs_no_error(topic, monkeypatch, caplog):
    monkeypatch.delenv("AIRFLOW__LLMOPS__NOTIFY_SNS_TOPIC_ARN")
    with caplog.at_level(logging.INFO):
        assert notify.stage_failed({"ti": FailingTI(), "exception": RuntimeError("boom")}) is False
        assert JobAlerts.from_settings({"name": "job-1"}) is None
    assert topic() == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("arn", ["sns-topic", "arn:aws:sqs:us-east-1:123456789012:q",
                                 "arn:aws:sns:us-east-1:1234:topic"])
def test_a_malformed_topic_arn_is_refused_naming_the_setting(arn, monkeypatch, caplog):
    monkeypatch.setenv("AIRFLOW__LLMOPS__NOTIFY_SNS_TOPIC_ARN", arn)
    with pytest.raises(notify.NotifySettingsError, match=r"\[llmops\] notify_sns_topic_arn"):
        notify.topic_arn()
    with caplog.at_level(logging.WARNING):
        assert notify.send("subject", "text") is False   # ... and sending says so, never raises
    assert any("notify_sns_topic_arn" in r.getMessage() for r in caplog.records)


def test_a_bad_queue_seconds_setting_names_itself(monkeypatch):
    monkeypatch.setenv("AIRFLOW__LLMOPS__NOTIFY_QUEUE_SECONDS", "an hour")
    with pytest.raises(notify.NotifySettingsError, match="notify_queue_seconds"):
        notify.queue_seconds()
    monkeypatch.setenv("AIRFLOW__LLMOPS__NOTIFY_QUEUE_SECONDS", "0")
    assert notify.queue_seconds() is None
    monkeypatch.delenv("AIRFLOW__LLMOPS__NOTIFY_QUEUE_SECONDS")
    assert notify.queue_seconds() == notify.DEFAULT_QUEUE_SECONDS


def test_sns_refusing_the_message_fails_neither_the_callback_nor_the_watch(topic, monkeypatch, tmp_path):
    # a well-formed ARN of a topic that does not exist: SNS answers NotFound
    monkeypatch.setenv("AIRFLOW__LLMOPS__NOTIFY_SNS_TOPIC_ARN",
                       topic.arn.rsplit(":", 1)[0] + ":no-such-topic")
    assert notify.stage_failed({"ti": FailingTI(), "exception": RuntimeError("boom")}) is False
    backend = LinesBackend([JobStatus(JobState.RUNNING), JobStatus(JobState.SUCCEEDED)], [ROLLBACK_LINE])
    watch = JobWatch(backend, handle(tmp_path), poll_interval=1, max_run_seconds=None,
                     alerts=JobAlerts.from_settings(handle(tmp_path)))
    assert drain(watch).state is JobState.SUCCEEDED
    assert topic() == []


def test_an_alert_that_raises_is_a_warning_of_the_poll(tmp_path):
    def broken(subject, message):
        raise ConnectionError("SNS is down")

    backend = LinesBackend([JobStatus(JobState.RUNNING), JobStatus(JobState.SUCCEEDED)], [ROLLBACK_LINE])
    watch = JobWatch(backend, handle(tmp_path), poll_interval=1, max_run_seconds=None,
                     alerts=JobAlerts(handle(tmp_path), sender=broken))
    warnings: list[str] = []
    assert drain(watch, warnings).state is JobState.SUCCEEDED
    assert any("could not send an alert: ConnectionError: SNS is down" in w for w in warnings)


# -- inside a running job ----------------------------------------------------------------------

class LinesBackend(ScriptedBackend):
    """The scripted backend, its job writing `lines` (each visible after one more status call)."""

    def __init__(self, statuses: list, lines: list[str]):
        super().__init__(statuses, lines=0)
        self.all_lines, self.polls = list(lines), 0

    def status(self, handle: dict[str, Any]) -> JobStatus:
        status = super().status(handle)
        self.polls += 1
        self.visible = min(len(self.all_lines), self.polls)   # one new line per poll
        return status


def handle(tmp_path) -> dict[str, Any]:
    return {"backend": "fake", "name": "pretrain-7f3a", "result_uri": str(tmp_path / "job" / "result.json")}


def drain(watch: JobWatch, warnings: list[str] | None = None) -> JobStatus:
    for _ in range(50):
        step = watch.poll()
        if warnings is not None:
            warnings.extend(step.warnings)
        if step.done:
            return step.status
    raise AssertionError("the watch did not end")


def test_a_rollback_and_a_stall_alert_once_each_across_polls_and_watches(tmp_path):
    sent: list[tuple[str, str]] = []
    lines = [ROLLBACK_LINE, "step 130/1000 | loss 2.31", ROLLBACK_LINE.replace("120", "140"),
             STALL_LINE, STALL_LINE, ROLLBACK_LINE]
    running = [JobStatus(JobState.RUNNING)] * 8

    def watch_once():
        backend = LinesBackend([*running, JobStatus(JobState.SUCCEEDED)], lines)
        alerts = JobAlerts(handle(tmp_path), {"dag_id": "llm_lifecycle", "run_id": "r1",
                                              "task_id": "pretrain", "map_index": -1},
                           sender=lambda s, m: sent.append((s, m)) or True)
        drain(JobWatch(backend, handle(tmp_path), poll_interval=1, max_run_seconds=None, alerts=alerts))

    watch_once()
    assert [s for s, _ in sent] == ["[llmops] llm_lifecycle pretrain: rollback",
                                    "[llmops] llm_lifecycle pretrain: stalled"]
    assert sent[0][1].splitlines()[0] == ("Job pretrain-7f3a rolled back from step 120 to step 100 "
                                          "after a loss spike.")
    assert sent[1][1].splitlines()[0] == ("Job pretrain-7f3a stalled: no progress from a worker for "
                                          "612 s (step 130, forward).")
    assert "Task pretrain in DAG llm_lifecycle, run r1." in sent[0][1]
    # A new watch of the same job (a triggerer restart, a retry that reattaches) sends neither
    # again, even when it reads the same lines again (its log cursor was lost, say).
    (tmp_path / "job" / "log-cursor.json").unlink()
    watch_once()
    assert len(sent) == 2
    assert json.loads((tmp_path / "job" / ALERTS_FILE).read_text())["sent"] == ["rollback", "stalled"]


def test_a_capacity_wait_past_the_threshold_alerts_once(tmp_path):
    now = [1000.0]
    sent: list[tuple[str, str]] = []
    backend = LinesBackend([JobStatus(JobState.PENDING, CAPACITY)] * 6 + [JobStatus(JobState.RUNNING),
                                                                          JobStatus(JobState.SUCCEEDED)], [])
    alerts = JobAlerts(handle(tmp_path), queue_seconds=3600, sender=lambda s, m: sent.append((s, m)) or True)
    watch = JobWatch(backend, handle(tmp_path), poll_interval=1200, max_run_seconds=None,
                     clock=lambda: now[0], submitted_at=1000.0, alerts=alerts)
    polls = 0
    while True:
        step = watch.poll()
        polls += 1
        if polls == 3:   # queued 40 min after two more polls: not yet
            assert sent == []
        if step.done:
            break
        now[0] += 1200
    [(subject, message)] = sent
    assert subject == "[llmops] pretrain-7f3a: capacity"
    assert message.splitlines()[0] == f"Job pretrain-7f3a still waiting for capacity after 60 min: {CAPACITY}."


def test_the_trigger_publishes_a_rollback_from_the_job_log(topic, monkeypatch, tmp_path):
    backend = LinesBackend([JobStatus(JobState.RUNNING)] * 3 + [JobStatus(JobState.SUCCEEDED)],
                           ["starting", ROLLBACK_LINE, ROLLBACK_LINE])
    monkeypatch.setattr(job_trigger, "get_backend", lambda name: backend)
    trigger = job_trigger.JobTrigger(handle=handle(tmp_path), poll_interval=0.01, max_run_seconds=3600,
                                     started_at=time.time(), context={"stage": "pretrain"})

    async def run() -> list[dict]:
        return [event.payload async for event in trigger.run()]

    [event] = asyncio.run(run())
    assert event["state"] == "succeeded"
    [(subject, message)] = topic()
    assert subject == "[llmops] pretrain-7f3a: rollback"
    assert message.startswith("Job pretrain-7f3a rolled back from step 120 to step 100 after a loss spike.")


def test_the_lifecycle_and_retrain_dags_alert_on_a_stage_failure():
    from airflow.dag_processing.dagbag import DagBag

    from tests.aws_fixtures import ROOT

    bag = DagBag(dag_folder=str(ROOT / "dags"))
    for dag_id in ("llm_lifecycle", "llm_retrain"):
        for task in bag.dags[dag_id].tasks:
            callbacks = task.on_failure_callback
            callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
            assert notify.stage_failed in callbacks, (dag_id, task.task_id)
            assert notify.stage_failed not in (task.on_retry_callback or []), (dag_id, task.task_id)


FAILING_DAG = '''
import pendulum
from airflow.sdk import dag, task

from llmops.infra import notify


@dag(dag_id="alerting", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
     default_args={"retries": 1, "retry_delay": pendulum.duration(seconds=0),
                   "on_failure_callback": notify.stage_failed})
def alerting():
    @task
    def pretrain():
        raise RuntimeError("pretrain job pretrain-7f3a failed: the job exited with code 5.\\nmore")

    pretrain()


alerting()
'''


def test_airflow_calls_it_once_on_the_final_failure_not_on_the_retry(topic, slack_webhook, airflow_db,
                                                                     tmp_path):
    from tests.isolated_env import airflow_cli

    (tmp_path / "dags").mkdir()
    (tmp_path / "dags" / "alerting.py").write_text(FAILING_DAG)
    done = airflow_cli("dags", "test", "alerting", "2026-12-04", dags_folder=tmp_path / "dags")
    assert "pretrain job pretrain-7f3a failed" in done.stdout + done.stderr
    [(subject, message)] = topic()   # the second try's failure only
    assert subject == "[llmops] alerting: pretrain failed"
    lines = message.splitlines()
    assert lines[0].startswith("Stage pretrain failed in DAG alerting, run ")
    assert lines[1] == "Reason: pretrain job pretrain-7f3a failed: the job exited with code 5."
    assert lines[2].startswith("Task log: http") and "/dags/alerting/runs/" in lines[2]
    assert lines[-1] == "Try 2: the task will not be retried."
    [posted] = slack_webhook.posts   # Slack too, from the task's own process, once
    assert posted["text"] == f"*{subject}*\n{message}"
    assert "s3cretWebhookToken" not in done.stdout + done.stderr   # the webhook's URL is no log line


def test_a_loss_that_stops_improving_for_n_evaluations_alerts_once(tmp_path, monkeypatch):
    sent: list[tuple[str, str]] = []
    losses = [3.0, 2.5, 2.4, 2.401, 2.399, 2.41, 2.5, 2.45, 2.6, 2.7]   # 2.399: under 0.1% better
    lines = [f"2026-12-04 INFO tasks.train.loop: step {100 * (i + 1)}/1000 | val_loss {loss:.4f} | "
             f"prose_val_loss 9.0000 | 10% eta 2h" for i, loss in enumerate(losses)]
    monkeypatch.setenv("AIRFLOW__LLMOPS__NOTIFY_SNS_TOPIC_ARN", "arn:aws:sns:us-east-1:123456789012:t")
    monkeypatch.setenv("AIRFLOW__LLMOPS__NOTIFY_PLATEAU_EVALS", "5")
    alerts = JobAlerts.from_settings(handle(tmp_path))
    alerts.sender = lambda s, m: sent.append((s, m)) or True
    backend = LinesBackend([JobStatus(JobState.RUNNING)] * 12 + [JobStatus(JobState.SUCCEEDED)], lines)
    drain(JobWatch(backend, handle(tmp_path), poll_interval=1, max_run_seconds=None, alerts=alerts))
    [(subject, message)] = sent
    assert subject == "[llmops] pretrain-7f3a: plateau"
    assert message.splitlines()[0] == (
        "Job pretrain-7f3a stopped improving: val_loss 2.4000 at step 300 is still the best after "
        "5 more evaluations (now 2.4500 at step 800).")
    monkeypatch.setenv("AIRFLOW__LLMOPS__NOTIFY_PLATEAU_EVALS", "0")
    assert JobAlerts.from_settings(handle(tmp_path)).plateau_evals is None
    monkeypatch.setenv("AIRFLOW__LLMOPS__NOTIFY_PLATEAU_EVALS", "five")
    with pytest.raises(notify.NotifySettingsError, match="notify_plateau_evals"):
        notify.plateau_evals()


class MailSink:
    """A local SMTP server (stdlib socketserver, speaking just enough of RFC 5321 for smtplib:
    greeting, EHLO/HELO, MAIL, RCPT, DATA, QUIT) that keeps each message it accepts, parsed."""

    def __init__(self):
        import email
        import socketserver
        import threading

        self.messages: list[tuple[list[str], Any]] = []
        sink = self

        class Session(socketserver.StreamRequestHandler):
            def handle(self):
                say = lambda line: self.wfile.write(f"{line}\r\n".encode())  # noqa: E731
                say("220 sink ready")
                recipients: list[str] = []
                for raw in self.rfile:
                    verb = raw.decode().strip().split(" ", 1)[0].upper()
                    if verb in ("EHLO", "HELO"):
                        say("250 sink")
                    elif verb == "RCPT":
                        recipients.append(raw.decode().split(":", 1)[1].strip(" <>\r\n"))
                        say("250 ok")
                    elif verb == "DATA":
                        say("354 go on")
                        body = b""
                        for line in self.rfile:
                            if line == b".\r\n":
                                break
                            body += line
                        sink.messages.append((recipients, email.message_from_bytes(body)))
                        recipients = []
                        say("250 queued")
                    elif verb == "QUIT":
                        say("221 bye")
                        return
                    else:   # MAIL, RSET, NOOP
                        say("250 ok")

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Session)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def mailbox(monkeypatch):
    sink = MailSink()
    monkeypatch.setenv("AIRFLOW_CONN_LLMOPS_ALERTS_SMTP", json.dumps(
        {"conn_type": "smtp", "host": "127.0.0.1", "port": sink.port,
         "extra": {"disable_ssl": True, "disable_tls": True, "from_email": "airflow@example.com",
                   "retry_limit": 0, "timeout": 10}}))
    monkeypatch.setenv("AIRFLOW__LLMOPS__NOTIFY_SMTP_CONN_ID", "llmops_alerts_smtp")
    monkeypatch.delenv("AIRFLOW__LLMOPS__NOTIFY_SNS_TOPIC_ARN", raising=False)
    yield sink
    sink.close()


def test_an_alert_is_e_mailed_where_addresses_are_configured(mailbox, monkeypatch):
    """The same alert as SNS's, through the smtp provider's notifier to a real (local) SMTP
    server: the recipients, the subject and the text a person reads, a masked secret masked."""
    from airflow.sdk.log import mask_secret

    monkeypatch.setenv("AIRFLOW__LLMOPS__NOTIFY_EMAIL_TO", "ml-oncall@example.com, ana@example.com")
    assert notify.configured()
    mask_secret("s3cr3t-token-value")
    error = RuntimeError("pretrain job failed: token s3cr3t-token-value refused <&>")
    assert notify.stage_failed({"ti": FailingTI(), "exception": error}) is True
    [(recipients, mail)] = mailbox.messages
    assert recipients == ["ml-oncall@example.com", "ana@example.com"]
    assert mail["Subject"] == "[llmops] llm_lifecycle: pretrain failed"
    assert mail["From"] == "airflow@example.com"
    html = next(p for p in mail.walk() if p.get_content_type() == "text/html").get_payload(decode=True).decode()
    assert "Stage pretrain failed in DAG llm_lifecycle, run manual__2026-12-04." in html
    assert "s3cr3t-token-value" not in html and "***" in html
    assert "&lt;&amp;&gt;" in html, "the reason is escaped, not read as HTML"


def test_a_malformed_address_or_a_dead_mail_server_is_a_warning_never_a_failure(mailbox, monkeypatch,
                                                                                   caplog):
    monkeypatch.setenv("AIRFLOW__LLMOPS__NOTIFY_EMAIL_TO", "ml-oncall")
    with caplog.at_level(logging.WARNING):
        assert notify.send("subject", "text") is False
    assert any("notify_email_to" in r.getMessage() and "ml-oncall" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("AIRFLOW__LLMOPS__NOTIFY_EMAIL_TO", "ml-oncall@example.com")
    mailbox.close()   # nothing listens any more
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert notify.send("subject", "text") is False
    assert any("Could not send the alert" in r.getMessage() and "ml-oncall@example.com" in r.getMessage()
               for r in caplog.records)
    assert mailbox.messages == []


class SlackWebhookSink:
    """A local HTTP server (stdlib http.server) that simulates Slack's Incoming Webhook endpoint
    (https://hooks.slack.com/services/T.../B.../...): it keeps each JSON body POSTed to the
    webhook's path and answers as Slack does, 200 "ok", or `status` when a test sets another."""

    PATH = "/services/T0LLMOPS/B0ALERTS/s3cretWebhookToken"

    def __init__(self):
        import http.server
        import threading

        self.posts: list[dict[str, Any]] = []
        self.status = 200
        sink = self

        class Hook(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                ok = self.path == sink.PATH and sink.status == 200
                if ok:
                    sink.posts.append(json.loads(body))
                reply = b"ok" if ok else (b"no_service" if self.path != sink.PATH else b"internal_error")
                self.send_response(sink.status if self.path == sink.PATH else 404)
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hook)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}{self.PATH}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def slack_webhook(monkeypatch):
    """The connection as the docs say to make it: conn type slackwebhook, the webhook's whole URL
    in its password (here the local sink's), given as AIRFLOW_CONN_<ID> like a secrets backend."""
    sink = SlackWebhookSink()
    monkeypatch.setenv("AIRFLOW_CONN_LLMOPS_ALERTS_SLACK", json.dumps(
        {"conn_type": "slackwebhook", "password": sink.url, "extra": {"timeout": 10}}))
    monkeypatch.setenv("AIRFLOW__LLMOPS__NOTIFY_SLACK_CONN_ID", "llmops_alerts_slack")
    yield sink
    sink.close()


def test_an_alert_is_posted_to_slack_where_a_connection_is_configured(slack_webhook, monkeypatch):
    """Through the slack provider's notifier to the (local) webhook: the subject in bold, the
    text a person reads, a masked secret masked, and nothing in a reason read as a mention."""
    from airflow.sdk.log import mask_secret

    monkeypatch.delenv("AIRFLOW__LLMOPS__NOTIFY_SNS_TOPIC_ARN", raising=False)
    monkeypatch.delenv("AIRFLOW__LLMOPS__NOTIFY_EMAIL_TO", raising=False)
    assert notify.configured()
    mask_secret("xoxb-sl4ck-secret-value")
    error = RuntimeError("pretrain job failed: token xoxb-sl4ck-secret-value refused <!channel> & co")
    assert notify.stage_failed({"ti": FailingTI(), "exception": error}) is True
    [posted] = slack_webhook.posts
    lines = posted["text"].splitlines()
    assert lines[0] == "*[llmops] llm_lifecycle: pretrain failed*"
    assert lines[1] == "Stage pretrain failed in DAG llm_lifecycle, run manual__2026-12-04."
    assert lines[2] == "Reason: pretrain job failed: token *** refused &lt;!channel&gt; &amp; co"
    assert "Run page: " + notify.run_url("llm_lifecycle", "manual__2026-12-04") in lines
    assert posted["unfurl_links"] is False


def test_slack_failing_never_keeps_the_alert_from_sns_and_e_mail(topic, mailbox, slack_webhook,
                                                                 monkeypatch, caplog):
    monkeypatch.setenv("AIRFLOW__LLMOPS__NOTIFY_SNS_TOPIC_ARN", topic.arn)   # mailbox unsets it
    monkeypatch.setenv("AIRFLOW__LLMOPS__NOTIFY_EMAIL_TO", "ml-oncall@example.com")
    slack_webhook.status = 500
    with caplog.at_level(logging.INFO):
        assert notify.send("[llmops] pretrain-7f3a: stalled", "Job pretrain-7f3a stalled.") is True
    assert topic() == [("[llmops] pretrain-7f3a: stalled", "Job pretrain-7f3a stalled.")]
    [(_, mail)] = mailbox.messages
    assert mail["Subject"] == "[llmops] pretrain-7f3a: stalled"
    assert slack_webhook.posts == []
    [warning] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "Could not send the alert" in warning and "llmops_alerts_slack" in warning
    assert "Status Code: 500" in warning
    # Slack not answering at all, the only channel: a warning, False, never an exception
    monkeypatch.delenv("AIRFLOW__LLMOPS__NOTIFY_SNS_TOPIC_ARN")
    monkeypatch.delenv("AIRFLOW__LLMOPS__NOTIFY_EMAIL_TO")
    slack_webhook.close()
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert notify.send("subject", "text") is False
    assert any("Could not send the alert" in r.getMessage() and "llmops_alerts_slack" in r.getMessage()
               for r in caplog.records)
    # the webhook's token (the secret in its URL) is in no line we logged
    assert not [r for r in caplog.records if "s3cretWebhookToken" in r.getMessage()]


@pytest.mark.parametrize("conn_id", ["llmops alerts", "slack;drop", "x" * 251,
                                     "https://hooks.slack.com/services/T0/B0/s3cretWebhookToken"])
def test_a_malformed_slack_conn_id_is_refused_naming_the_setting(conn_id, monkeypatch, caplog):
    monkeypatch.delenv("AIRFLOW__LLMOPS__NOTIFY_SNS_TOPIC_ARN", raising=False)
    monkeypatch.setenv("AIRFLOW__LLMOPS__NOTIFY_SLACK_CONN_ID", conn_id)
    assert notify.configured()
    with pytest.raises(notify.NotifySettingsError, match=r"\[llmops\] notify_slack_conn_id"):
        notify.slack_conn_id()
    with caplog.at_level(logging.WARNING):
        assert notify.send("subject", "text") is False
    [warning] = [r.getMessage() for r in caplog.records]
    assert "notify_slack_conn_id" in warning and "s3cretWebhookToken" not in warning
