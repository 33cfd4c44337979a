"""Training for notebooks and batch jobs: TrainConfig, Trainer, data, checkpoints.

``torchrun --nproc-per-node N -m mlmkit.train --config run.json`` runs the same training as a
notebook; see :mod:`mlmkit.train.__main__`.
"""

from mlmkit.train.config import TrainConfig, demo_config

__all__ = ["TrainConfig", "Trainer", "demo_config", "load_checkpoint", "save_checkpoint", "export_state_dict",
           "time_layouts"]


def __getattr__(name):
    # Trainer and checkpoints need torch.distributed; the config stays importable without it.
    if name in ("Trainer", "time_layouts"):
        from mlmkit.train import trainer

        return getattr(trainer, name)
    if name in ("load_checkpoint", "save_checkpoint", "export_state_dict"):
        from mlmkit.train import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'mlmkit.train' has no attribute {name!r}")
