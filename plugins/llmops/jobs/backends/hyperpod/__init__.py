"""SageMaker HyperPod on EKS: the Kubernetes client (hook.py), the job resource as pure functions
(manifest.py, validated against crds/), the backend (backend.py) and its settings block
(settings.py)."""
