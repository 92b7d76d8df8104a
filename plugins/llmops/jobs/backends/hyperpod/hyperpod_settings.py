"""The `hyperpod` block of the backends' settings (llmops.jobs.backends.backend_settings), the job
kinds and their default namespaces, and where HyperPod auto-resumes a job."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmops.jobs.backends.remote_settings import BackendSettingsError, RemoteSettings


@dataclass(kw_only=True)
class HyperPodSettings(RemoteSettings):
    kind: str = "HyperPodPyTorchJob"    # or PyTorchJob (Kubeflow training operator)
    eks_cluster_name: str = ""          # credentials through EksHook and aws_conn_id ...
    kubernetes_conn_id: str = ""        # ... or a Kubernetes connection instead
    # May use {team}: hyperpod-ns-{team} under task governance. "" = the kind's DEFAULT_NAMESPACES.
    # HyperPod auto-resumes a PyTorchJob only in `kubeflow` or a namespace starting `hyperpod`.
    namespace: str = ""
    queue_name: str = ""                # Kueue local queue, e.g. hyperpod-ns-{team}-localqueue
    priority_classes: dict = field(default_factory=dict)  # min priority -> class, {"0": "low", "500": "high"}
    service_account: str = ""
    gpus_per_node: int = 0
    efa_per_node: int = 0
    cpu: str = ""                       # per node, Kubernetes quantities: "90", "1000Gi"
    memory: str = ""
    node_selector: dict = field(default_factory=dict)
    max_retry_count: int = 3            # HyperPod auto-resume: restarts after a node fault
    require_healthy_nodes: bool = True  # only nodes HyperPod's health checks mark Schedulable
    # HyperPod hang/slowness detection from the job's log lines (HyperPodPyTorchJob only).
    log_monitoring: list = field(default_factory=lambda: [{
        "name": "training-step-progress",
        "logPattern": r".*step (\d+)/\d+.*",
        "expectedStartCutOffInSeconds": 1800,
        "expectedRecurringFrequencyInSeconds": 900,
    }])

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kind not in HYPERPOD_KINDS:
            raise BackendSettingsError(f"HyperPodSettings.kind {self.kind!r} is not one of "
                                       f"{list(HYPERPOD_KINDS)}.")
        if self.max_retry_count < 0:
            raise BackendSettingsError(f"HyperPodSettings.max_retry_count must be >= 0, got "
                                       f"{self.max_retry_count}.")
        if "{" not in self.namespace:   # with {team}, checked once the run's team is known
            check_auto_resume_namespace(self, self.resolved_namespace())

    def resolved_namespace(self, team: str = "default") -> str:
        """The namespace a job of `team` goes to."""
        return (self.namespace or DEFAULT_NAMESPACES[self.kind]).format(team=team)


# Where a job goes when the settings name no namespace. A PyTorchJob gets HyperPod's auto-resume
# (the job-auto-resume annotations) only in these namespaces; the HyperPod training operator
# resumes its own HyperPodPyTorchJob (runPolicy.jobMaxRetryCount) in any.
HYPERPOD_KINDS = ("HyperPodPyTorchJob", "PyTorchJob")
DEFAULT_NAMESPACES = {"HyperPodPyTorchJob": "default", "PyTorchJob": "kubeflow"}


def auto_resumes(kind: str, namespace: str) -> bool:
    """Whether HyperPod restarts a job of `kind` in `namespace` after a node fault."""
    return kind != "PyTorchJob" or namespace == "kubeflow" or namespace.startswith("hyperpod")


def check_auto_resume_namespace(settings: HyperPodSettings, namespace: str) -> None:
    """Refuse a PyTorchJob that asks for auto-resume (max_retry_count > 0) in a namespace where
    HyperPod silently does not give it: after a node fault it would fail, not resume."""
    if settings.max_retry_count and not auto_resumes(settings.kind, namespace):
        raise BackendSettingsError(
            f"HyperPodSettings.namespace {namespace!r}: HyperPod auto-resumes a PyTorchJob only in "
            "the 'kubeflow' namespace or one starting with 'hyperpod' (e.g. hyperpod-ns-{team}). "
            "Set namespace to one of those, kind to HyperPodPyTorchJob, or max_retry_count to 0 "
            "to run without auto-resume.")
