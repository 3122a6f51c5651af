"""2D target distributions for the flow demos (each returns ``[N, 2]``, roughly unit scale)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from flowlib.flows.models import METHODS, FlowModel, MeanFlow, MeanFlowTimes, ReFlow, ShortCut
from flowlib.flows.nets import ConditionalMLP
from flowlib.infra import progress
from flowlib.infra.config import (
    Fraction,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    check_fields,
    require,
)
from flowlib.infra.guards import require_finite


def two_moons(n: int, generator=None, noise: float = 0.05) -> torch.Tensor:
    """Two interleaved half circles (as in scikit-learn's make_moons), centred and scaled."""
    n_top = n // 2
    angle = math.pi * torch.rand(n, generator=generator)
    top = torch.stack([torch.cos(angle[:n_top]), torch.sin(angle[:n_top])], dim=1)
    bottom = torch.stack([1 - torch.cos(angle[n_top:]), 0.5 - torch.sin(angle[n_top:])], dim=1)
    x = torch.cat([top, bottom]) + noise * torch.randn(n, 2, generator=generator)
    x = (x - torch.tensor([0.5, 0.25])) * 1.6
    return x[torch.randperm(n, generator=generator)]


def checkerboard(n: int, generator=None, squares: int = 4) -> torch.Tensor:
    """Uniform on the black squares of a ``squares x squares`` board on ``[-2, 2]^2``."""
    width = 4.0 / squares
    cell = torch.randint(0, squares * squares // 2, (n,), generator=generator)
    row = cell // (squares // 2)
    col = 2 * (cell % (squares // 2)) + (row % 2)
    offset = torch.rand(n, 2, generator=generator) * width
    return torch.stack([col * width - 2.0, row * width - 2.0], dim=1) + offset


def eight_gaussians(n: int, generator=None, radius: float = 2.0, std: float = 0.15) -> torch.Tensor:
    """Eight isotropic Gaussians evenly spaced on a circle."""
    k = torch.randint(0, 8, (n,), generator=generator)
    return eight_gaussian_means(radius)[k] + std * torch.randn(n, 2, generator=generator)


TARGETS = {"two_moons": two_moons, "checkerboard": checkerboard, "eight_gaussians": eight_gaussians}


def eight_gaussian_means(radius: float = 2.0) -> torch.Tensor:
    """The ``[8, 2]`` centres of ``eight_gaussians``."""
    k = torch.arange(8).float()
    return radius * torch.stack([torch.cos(k * math.pi / 4), torch.sin(k * math.pi / 4)], dim=1)


def mixture_velocity(x: torch.Tensor, t: torch.Tensor, means: torch.Tensor, std: float) -> torch.Tensor:
    """The exact flow-matching velocity ``E[x_1 - x_0 | x_t = x]`` for data = an equal-weight mixture of
    ``N(mu_j, std^2 I)`` and noise ``N(0, I)``, on the path ``x_t = (1 - t) x_0 + t x_1``.

    Given component ``j``, ``x_t ~ N(t mu_j, s_t^2 I)`` with ``s_t^2 = (1 - t)^2 + t^2 std^2`` and
    ``E[x_1 - x_0 | x_t, j] = mu_j + (t std^2 - (1 - t)) / s_t^2 (x - t mu_j)``; the velocity is their
    average under the posterior ``p(j | x_t)``.  ``x [B, D]``, ``t [B]``, ``means [J, D]`` -> ``[B, D]``.
    """
    t = t.reshape(-1, 1, 1)                                             # [B, 1, 1]
    var = (1 - t) ** 2 + t ** 2 * std ** 2                              # [B, 1, 1]
    diff = x[:, None, :] - t * means[None]                              # [B, J, D]
    logits = -0.5 * (diff ** 2).sum(-1, keepdim=True) / var             # [B, J, 1]
    post = torch.softmax(logits, dim=1)
    v_j = means[None] + (t * std ** 2 - (1 - t)) / var * diff           # [B, J, D]
    return (post * v_j).sum(1)


def sample_target(name: str, n: int, seed: int | None = None) -> torch.Tensor:
    """``n`` samples of the named 2D target; the same ``seed`` gives the same samples."""
    if name not in TARGETS:
        raise ValueError(f"unknown 2D target {name!r}; choose one of {sorted(TARGETS)}")
    g = None if seed is None else torch.Generator().manual_seed(seed)
    return TARGETS[name](n, generator=g)


@dataclass
class Flows2DConfig:
    """Parameters of notebook 00 (2D flows). Defaults are the small CPU run."""

    seed: NonNegativeInt = 0
    targets: list[str] = field(default_factory=lambda: ["two_moons", "checkerboard"])  # 2D data sets to fit (two_moons, checkerboard, ...)
    methods: list[str] = field(default_factory=lambda: ["reflow", "meanflow", "shortcut"])  # flow models to compare; reflow is the baseline and must be listed
    train_steps: PositiveInt = 3000
    batch_size: PositiveInt = 256
    lr: PositiveFloat = 3e-3
    hidden: PositiveInt = 128  # width of the velocity MLP's hidden layers
    depth: PositiveInt = 3  # hidden layers of the velocity MLP
    emb_scale: PositiveFloat = 10.0         # time-embedding scale (1000 makes MeanFlow's du/dt stiff)
    ema_decay: Fraction = 0.99              # also ShortCut's teacher: slower EMAs starve the doubling chain
    meanflow_share_distinct: Fraction = 0.25  # share of (t, s) pairs with s and t apart
    meanflow_adaptive_p: NonNegativeFloat = 0.5  # adaptive loss weight 1 / (||err||^2 + eps)^p
    shortcut_bootstrap_fraction: Fraction = 0.25  # share of each batch given the self-consistency target
    shortcut_max_steps: PositiveInt = 128  # finest ShortCut step is 1 / shortcut_max_steps
    eval_steps: list[PositiveInt] = field(default_factory=lambda: [1, 2, 4, 8, 128])  # numbers of integration steps K at which samples are scored
    eval_samples: PositiveInt = 4000  # samples per score (sliced Wasserstein-1 against held-out data)
    run_name: str = "default"
    wandb_mode: str = "disabled"

    def __post_init__(self):
        check_fields(self)
        for name in self.targets:
            if name not in TARGETS:
                raise ValueError(f"unknown target {name!r}; choose from {sorted(TARGETS)}")
        for name in self.methods:
            if name not in METHODS:
                raise ValueError(f"unknown method {name!r}; choose from {sorted(METHODS)}")
        require([("reflow" in self.methods, f"methods = {self.methods} lacks 'reflow', the multi-step baseline the "
                  "notebook measures the others against: add it (e.g. methods: [reflow, shortcut])"),
                  (len(set(self.methods)) == len(self.methods) and len(set(self.targets)) == len(self.targets),
                   "methods and targets must not repeat a name")])


def build_model(method: str, cfg: Flows2DConfig) -> FlowModel:
    """A ReFlow / MeanFlow / ShortCut model on a ``ConditionalMLP`` sized by ``cfg``."""
    net = ConditionalMLP(dim=2, hidden=cfg.hidden, depth=cfg.depth, emb_scale=cfg.emb_scale)
    if method == "reflow":
        return ReFlow(net, ema_decay=cfg.ema_decay)
    if method == "meanflow":
        return MeanFlow(net, ema_decay=cfg.ema_decay, adaptive_p=cfg.meanflow_adaptive_p,
                        times=MeanFlowTimes(share_distinct=cfg.meanflow_share_distinct))
    if method == "shortcut":
        return ShortCut(net, ema_decay=cfg.ema_decay, max_steps=cfg.shortcut_max_steps,
                        bootstrap_fraction=cfg.shortcut_bootstrap_fraction)
    raise ValueError(f"unknown method {method!r}; choose from {sorted(METHODS)}")


def train_2d(model: FlowModel, target: str, cfg: Flows2DConfig, tracker=None, desc: str = "",
             bar=None) -> list[float]:
    """Fit ``model`` to fresh samples of ``target`` each step (AdamW, cosine LR); returns the losses.

    Progress goes to ``bar`` (a shared ``flowlib.infra.progress.bar``) if given, else to a bar of its own.
    """
    torch.manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.net.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.train_steps)
    losses = []
    own = bar is None
    bar = progress.bar(cfg.train_steps, desc or target, unit="step") if own else bar
    for step in range(cfg.train_steps):
        x1 = TARGETS[target](cfg.batch_size)
        loss, info = model.loss(x1)
        require_finite(loss, f"{target} {type(model).__name__} loss", f"step {step}", "lower lr or emb_scale")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        model.update_ema()
        losses.append(info["loss"])
        bar.update()
        if tracker is not None and step % 100 == 0:
            tracker.log({f"{desc}/{k}": v for k, v in info.items()}, step)
    if own:
        bar.close()
    return losses
