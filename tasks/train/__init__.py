"""What the training stages share: data loading, the lr schedule, atomic checkpoints, the one
training loop (pretraining, sweep trials, fine-tuning and distillation differ only in their
model, batches and loss), scoring, and the exported model directory.

Resilient pretraining adds: pretraining.py (what `python -m tasks.pretrain` runs: the job's
supervisor and worker sides, the training and its report), supervisor.py (the in-job supervisor,
hang watchdog and hot spare), distributed.py (DDP/FSDP and process groups re-formed in place),
guard.py (NaN and spike detection), faults.py (fault injection), telemetry.py (events, step times,
heartbeat), goodput.py and checkpoint_s3.py (checkpoints mirrored to S3)."""
