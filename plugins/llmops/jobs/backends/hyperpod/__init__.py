"""SageMaker HyperPod on EKS: the Kubernetes client (hyperpod_hook.py), the job resource as pure
functions (hyperpod_manifest.py, validated against crds/), the backend (hyperpod_backend.py) and
its settings block (hyperpod_settings.py)."""
