"""flowlib: flow-matching policies and their RL fine-tuning, one vetted implementation of each algorithm.

The folders are the layers, bottom to top; a module imports only from its own folder and the ones below
(tests/test_layers.py; docs/architecture.md draws them). Each folder's ``__init__`` lists its modules, one job each:

infra     config, runs, tracking, progress, guards, sysdeps, lab, schedules, metrics, grad_signal
flows     models (ReFlow, MeanFlow, ShortCut), diffusion (DDPM), nets, unet, distributions, flow_sde, toy2d
envs      tasks, maniskill (make_env), metaworld_envs, fast_envs, fast_avoid, fast_tasks, vector, visual,
          visual_demos, data, smdp
policies  encoders, chunk_policy, policy_eval, bc (stage 1), critic, awsc (stage 2)
rl        advantages, ppo, buffers, loop, learners, asymmetric
methods   chain_score, reinflow_agent, reinflow, steering, latent, latent_sac, residual, residual_step, residual_td3,
          residual_step_ppo, gaussian, rfc, fql, registry, stage3
tools     run, evaluate, results, verdicts, seeds, sweep, sweep_report, export, bench, pirl

The commands keep their short names: ``python -m flowlib.run``, ``flowlib.evaluate``, ``flowlib.results``,
``flowlib.seeds``, ``flowlib.sweep``, ``flowlib.export``, ``flowlib.sysdeps``. The flat paths of before the folders
(``flowlib.bc``) still import, with a FutureWarning naming the new one, until the next release (flowlib/_moved.py).
"""
from flowlib import _moved

_moved.install()

__version__ = "0.1.0"
