"""SageMaker Training and Processing: the hook (sagemaker_hook.py), the requests as pure
functions (sagemaker_requests.py), the backends (sagemaker_backend.py) and their settings blocks
(sagemaker_settings.py)."""
