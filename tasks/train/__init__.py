"""What the training stages share: data loading, the lr schedule, atomic checkpoints, the one
training loop (pretraining, sweep trials, fine-tuning and distillation differ only in their
model, batches and loss), scoring, and the exported model directory."""
