"""Shared pieces of the parity tests (module-level so ranks can unpickle them)."""

from mlmkit.distributed import ProcessGroups
from mlmkit.model import gather_full
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


def expert_names(trainer) -> set:
    """The names of this rank's expert parameters."""
    return {n for c in trainer.chunks for n, p in c.named_parameters() if getattr(p, "expert", False)}


def one_copy(cfg, groups, trainer, tensors: dict) -> dict:
    """The whole tensors this rank contributes so that the ranks' results merge into one copy of
    each: dense ones from the tp = cp = dp = 0 rank of each stage, experts from their own
    expert-tp = expert-dp = 0 rank."""
    experts = expert_names(trainer)
    c, e = groups.coords, cfg.topology.expert_coords(groups.rank)
    dense, expert = c.tp == 0 and c.dp == 0 and c.cp == 0, e.tp == 0 and e.dp == 0
    return {n: t for n, t in tensors.items() if (expert if n in experts else dense)}


def reduced_gradients(cfg, groups, trainer) -> dict:
    """Every gradient of this rank's chunks (finalised, before the optimizer; ZeRO stage 0 or 1),
    gathered to its full shape over tp and averaged over its replicas as the optimizer's reduction
    makes it: dense ones over dp x cp, experts over their expert-dp group (mlmkit.moe.layer)."""
    experts = expert_names(trainer)
    grads = {}
    for chunk in trainer.chunks:
        grads.update(gather_full(chunk, grads=True))
    for name, g in grads.items():
        if name in experts:
            groups.expert_dp.all_reduce(g, site="test")
            g.div_(cfg.dp * cfg.cp)
        else:
            groups.dp_cp.all_reduce(g, site="test")
            g.div_(groups.dp_cp.size)
    return grads


# bf16 parameters after a few AdamW steps. Early Adam updates are ~lr * sign(g), so an element whose
# gradient is near zero moves by +-lr on any rounding noise, and splitting a matmul over ranks changes
# where bf16 rounds (a row-parallel layer's partial sums are rounded before their all-reduce, as in
# Megatron-LM). A layout therefore sits about as far from the exact (fp32) parameters as the serial
# bf16 run does, often somewhat farther, in another direction: the difference between the two runs is
# held to BF16_OWN_ERROR_FACTOR times bf16's own error (serial bf16 against serial fp32), or 2% of the
# parameter's norm. Measured (llama, cp=2 x tp=2, 3 steps, a host without AVX-512): the worst healthy
# parameter (attention's output projection) used 0.72 of this bound (1.08 of the former bound, twice
# the own error), while the same layout with the dp-cp gradient reduction left out put the median
# parameter at 4x the bound and the worst at 9x.
# A row-parallel layer's output is the sum of tp partial products, each rounded to bf16, so its
# rounding noise grows about as sqrt(tp): the factor is BF16_OWN_ERROR_FACTOR * sqrt(tp / 2) for tp
# above 2. Measured (llama, 3 steps, data seeds 0-3): the worst row-parallel weight at tp=4 sat 2.3-4.1
# times the own error from the fp32 parameters (1.4-2.8 at tp=2), 1.36 of the unscaled bound for seed 0.
BF16_OWN_ERROR_FACTOR = 3.0
BF16_PARAM_RTOL = 2e-2


def bf16_params_close(got, want, fp32_want, *, tp: int = 1) -> bool:
    """``got`` (a layout's bf16 parameter) against ``want`` (the serial bf16 run's), given the serial
    fp32 run's ``fp32_want`` and the layout's tensor-parallel degree: see :data:`BF16_OWN_ERROR_FACTOR`."""
    got, want, exact = got.double(), want.double(), fp32_want.double()
    own = (want - exact).norm().item()
    factor = BF16_OWN_ERROR_FACTOR * max(1.0, (tp / 2) ** 0.5)
    return (got - want).norm().item() <= max(BF16_PARAM_RTOL * want.norm().item(), factor * own) + 1e-12
