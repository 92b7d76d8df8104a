"""One sweep trial: a short pretraining run whose val loss ranks its hyperparameters.

    python -m tasks.sweep --config CONFIG.json --result RESULT.json   (a TrainConfig)

The DAG maps one trial per learning rate (SweepConfig.learning_rates) and picks the lowest
val_loss. Trials skip the model directory and MLflow model: only their numbers are needed.
"""

from __future__ import annotations

from typing import Any

from tasks.common.entry import run_stage
from tasks.configs import TrainConfig
from tasks.pretrain import pretrain


def main(cfg: TrainConfig) -> dict[str, Any]:
    return pretrain(cfg, stage="sweep", publish=False)


if __name__ == "__main__":
    run_stage("sweep", TrainConfig, main)
