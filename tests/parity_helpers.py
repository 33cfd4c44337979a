"""Shared pieces of the parity tests (module-level so ranks can unpickle them)."""

from mlmkit.distributed import ProcessGroups
from mlmkit.train import TrainConfig
from mlmkit.train.trainer import Trainer


def first_step_gradients(world_size: int, cfg_dict: dict):
    """A trainer for ``cfg_dict`` on this rank (the serial model when ``world_size`` is 1) that has
    run every action of its first step and finalised the gradients, before the optimizer:
    ``(cfg, groups, trainer)``; ``trainer.finish_step()`` completes the step."""
    cfg = TrainConfig.from_dict(cfg_dict)
    groups = ProcessGroups.build(cfg.topology) if world_size > 1 else ProcessGroups.single()
    trainer = Trainer(cfg, groups=groups)
    trainer.begin_step()
    while not trainer.executor.done:
        trainer.executor.step_action()
    trainer.executor.finalize()
    return cfg, groups, trainer
