"""flows: the generative models and their stochastic samplers (imports infra only).

    models    ReFlow, MeanFlow, ShortCut; the time convention (t = 0 noise, t = 1 data); the sampler
    nets      velocity networks with the interface net(x, t, d, obs); MLPs, twin Q; ReinFlow's noise net
    diffusion DDPM, stage 1's diffusion baseline: epsilon prediction, DDPM / DDIM sampling by diffusers' schedulers
    unet      ShortCutVelocityUNet1D, the 1D temporal U-Net over action chunks; ChunkVelocityMLP
    distributions  diagonal and chunk-correlated Gaussians: log-densities, entropies, correlated noise
    flow_sde  stochastic denoising steps: score from velocity, Flow-SDE, Flow-CPS, learned noise, hybrid masks
    toy2d     2D targets, the exact velocity of a Gaussian mixture, the notebook-00 experiment

Until the next release ``flowlib.flows.ShortCut`` (the old flat module's names) still resolves, with a FutureWarning
that names ``flowlib.flows.models``.
"""
from flowlib._moved import old_names_of

__getattr__ = old_names_of("flowlib.flows", "flowlib.flows.models")
