# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: tags,-all
#     formats: ipynb,py:percent
#     notebook_metadata_filter: kernelspec,jupytext,-jupytext.text_representation.jupytext_version
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 04 · Flow-SDE and Flow-Noise (piRL): making a flow policy stochastic, two ways
#
# PPO needs $\log\pi(a\mid o)$. A flow policy's action comes out of a deterministic ODE, so piRL
# (Chen et al. 2025) turns the $K$-step sampler into a chain of Gaussian transitions
# $p(x_{k+1}\mid x_k, o) = \mathcal N(\mu_k, \Sigma_k)$ whose product is an exact likelihood. The methods
# differ only in $\mu_k$ and $\Sigma_k$ (`flowlib.flows.flow_sde.transition`); everything else (chunks as a
# semi-MDP, PPO) is notebook 03's machinery.
#
# **Clock.** flowlib's convention: $t=0$ is noise, $t=1$ data, $x_t=(1-t)x_0+t\,x_1$, $x_0\sim\mathcal N(0,I)$,
# $v(x,t)=\mathbb E[x_1-x_0\mid x_t=x]$. piRL, Flow-GRPO and RLinf run the other way ($t=1$ noise); every
# formula below is theirs under $t\to 1-t$, $v\to -v$.
#
# **Score from velocity.** Since $x_t = x_0 + t(x_1-x_0)$, $\ \mathbb E[x_0\mid x_t=x] = x - t\,v(x,t)$, and
# Tweedie's formula for the Gaussian part $(1-t)x_0$ gives
# $$\nabla_x\log p_t(x) = -\frac{\mathbb E[x_0\mid x_t=x]}{1-t} = -\frac{x - t\,v(x,t)}{1-t}.$$
# (`flowlib.flows.flow_sde.score_from_velocity`)
#
# **SDEs with the ODE's marginals.** The probability-flow ODE $dx = v\,dt$ and, for any $\sigma_t$,
# $$dx = \Big[v + \tfrac{\sigma_t^2}{2}\nabla\log p_t\Big]dt + \sigma_t\,dW
#      = \Big[v - \frac{\sigma_t^2}{2(1-t)}(x - t v)\Big]dt + \sigma_t\,dW$$
# have the same Fokker-Planck equation: the extra drift $\tfrac{\sigma^2}{2}\nabla\log p$ is cancelled by the
# diffusion's $\tfrac{\sigma^2}{2}\Delta p$ (piRL Eq. 8 in our clock). piRL picks $\sigma_t = a\sqrt{t/(1-t)}$ in
# its clock (Eq. 9), i.e. $\sigma_t = a\sqrt{(1-t)/t}$ in ours: large near the noise, zero at the data.
# It is infinite at $t=0$; RLinf's guard, used here, puts $t=\Delta t$ in the denominator of the first step.
# One Euler-Maruyama step is Gaussian (`flowlib.flows.flow_sde.transition`, scored by `flowlib.flows.distributions.gaussian_log_prob`):
# $$\mu_k = x_k + \Big[v - \frac{\sigma_{t_k}^2}{2(1-t_k)}(x_k - t_k v)\Big]\Delta t,\qquad
#   \Sigma_k = \sigma_{t_k}^2\,\Delta t\; I .$$
# At $a=0$ it is the ODE step.
#
# **Flow-CPS** (coefficient-preserving, as in RLinf's `flow_cps`): predict the data $\hat x_1 = x + (1-t)v$
# and the noise $\hat x_0 = x - t v$, and re-mix the noise with fresh noise at the next time $s = t+\Delta t$:
# $x_s = s\,\hat x_1 + (1-s)[\cos(\tfrac{\pi a}{2})\hat x_0 + \sin(\tfrac{\pi a}{2})\epsilon]$. Its last step has
# zero variance and never enters a log-probability.
#
# **Flow-Noise** is ReinFlow's learned noise net ($\mu_k$ = the Euler step, $\Sigma_k = \sigma_\theta(t_k,o)^2$),
# with the initial noise $\log\mathcal N(x_0;0,I)$ in the joint log-probability
# $\log\pi(x_{0:K}) = \log\mathcal N(x_0) + \sum_k \log\mathcal N(x_{k+1};\mu_k,\Sigma_k)$. That term does not
# depend on $\theta$, so it cancels in the PPO ratio when steps are **summed** (`log_prob_reduce="sum"`, exact);
# with `"mean"` (RLinf's choice) the ratio is the geometric mean over the $K+1$ terms, a smaller step.
#
# **Hybrid ODE-SDE.** In training, each sample draws one step $k^\ast$ uniformly; that step is stochastic,
# the others are ODE steps, and only $\log p(x_{k^\ast+1}\mid x_{k^\ast})$ enters the ratio. Re-scoring costs
# one network call per sample instead of $K$. Evaluation is the pure ODE.
#
# **One- or two-layer MDP** (piRL Eq. 10-12, 15). One layer: the chain is one action with ratio
# $\rho = \prod_k \rho_k$ over its stochastic steps (`ratio_mode="joint"`). Two layers: every denoising step is a
# transition of an inner MDP with zero reward and no discount, so each stochastic step gets the env decision's
# advantage and its own clipped ratio $\rho_k$, and the loss averages over them (`ratio_mode="per_step"`).
# With one stochastic step (hybrid) the two coincide.
#
# **PPO toolkit** (`flowlib.rl.ppo`): GAE / Monte-Carlo / $n$-step / GRPO advantages (GRPO groups = envs reset
# from the same seed, one episode each), dual-clip PPO, clipped Huber value loss, and a critic either on the
# observation (`critic_input="obs"`, piRL's $V_\text{vlm}$ analogue) or on the velocity net's features averaged
# along the deterministic chain (`"velocity_features"`, the $V_\text{expert}$ analogue, optionally detached).

# %%
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from flowlib.infra import config, runs
from flowlib.flows import flow_sde, toy2d
from flowlib.tools import pirl
from flowlib.envs.maniskill import make_env
from flowlib.infra.tracking import start_run
from flowlib.tools.run import start_checkpoint

# %% tags=["parameters"]
# Defaults: the small CPU run (a few minutes). params/04_flow_sde/cpu.yaml is the reported comparison.
seed: int = 0  # seed of torch and of the run's random draws
noise_levels: list[float] = [0.2, 0.5, 1.0]  # SDE noise levels a compared with the ODE
marginal_steps: int = 100  # K of the marginal check
marginal_samples: int = 4000  # samples per marginal comparison
logprob_steps: list[int] = [2, 4, 8, 16, 32]  # chain lengths K of the log-probability table
reflow_train_steps: int = 1500  # the trained 2D model (notebook 00's ReFlow on two_moons)
init_checkpoint: str = "01_shortcut_bc/fast_reach_mlp/best_model.pt"  # stage-1/2 best_model.pt under outputs/
methods: list[str] = ["reinflow", "flow_noise", "flow_sde", "flow_sde+hybrid"]  # noise methods fine-tuned (reinflow, flow_noise, flow_sde, flow_sde+hybrid)
seeds: list[int] = [0]  # one fine-tuning run per method and seed
finetune: dict = {"env_id": "FastReach-v0", "num_envs": 512, "max_episode_steps": 40, "num_inference_steps": 4, "log_prob_over": "executed_last", "max_noise_std": 0.1, "final_noise_std": 0.04, "min_noise_std": 0.02, "noise_decay_steps": 10000000, "noise_level": 0.15, "total_env_steps": 1228800, "rollout_steps": 10, "update_epochs": 5, "minibatch_size": 2048, "actor_lr": 0.0001, "critic_lr": 0.001, "target_kl": 0.05, "critic_warmup_steps": 81920, "eval_every": 10, "num_eval_episodes": 512, "ckpt_every": 10}  # notebook 03's parameters shared by every method's run
num_threads: int = 1  # torch CPU threads (0 means torch's default)
resume: bool = True  # go on from the run folder's last.pt when there is one
run_name: str = "default"  # the run folder, outputs/<notebook>/<run_name>
wandb_mode: str = "disabled"  # disabled, offline (a local W&B run) or online

# %%
cfg = config.from_globals(pirl.FlowSDEConfig, globals())
run_path, tracker = start_run("04_flow_sde", cfg)
print(f"run folder: {runs.shown(run_path)}")

# %% [markdown]
# ## 1 · The marginals, with an exact velocity
# For data = eight Gaussians (std 0.15) the velocity field is known in closed form
# (`toy2d.mixture_velocity`), so any gap between SDE and ODE samples is the SDE's (or its discretisation's),
# not a model's. Same $x_0$ for ODE and SDE; the yardstick is the sliced Wasserstein distance between two
# independent ODE sample sets of the same size. Target: SDE-vs-ODE no larger than 1.5 times the yardstick.

# %%
means = toy2d.eight_gaussian_means()
exact = lambda x, t: toy2d.mixture_velocity(x, t, means, 0.15)
exact_rows = pd.DataFrame(pirl.marginal_table(exact, cfg.marginal_steps, cfg.noise_levels, cfg.marginal_samples,
                                              cfg.seed))
exact_rows.round(4)

# %%
# NBVAL_CHECK_OUTPUT
print(f"exact velocity, K = {cfg.marginal_steps}: every a within 1.5x of ODE-vs-ODE: {bool(exact_rows['within_1.5x'].all())}")
print(f"paths differ from the ODE's (mean endpoint move > 0.1): {bool((exact_rows.path_moved > 0.1).all())}")

# %% [markdown]
# ## 2 · The same with a trained model (notebook 00's ReFlow on two moons)
# Now the score comes from a learned velocity, $-(x - t\,v_\theta)/(1-t)$, so errors of $v_\theta$ enter
# the SDE drift amplified by $\sigma_t^2/(2(1-t))$.

# %%
flows_cfg = toy2d.Flows2DConfig(seed=cfg.seed, train_steps=cfg.reflow_train_steps)
model = toy2d.build_model("reflow", flows_cfg)
toy2d.train_2d(model, "two_moons", flows_cfg, desc="reflow two_moons")
net = model.sampling_net()
learned = lambda x, t: model.step_velocity(net, x, t, 1.0 / cfg.marginal_steps)
with torch.no_grad():
    learned_rows = pd.DataFrame(pirl.marginal_table(learned, cfg.marginal_steps, cfg.noise_levels,
                                                    cfg.marginal_samples, cfg.seed))
learned_rows.round(4)

# %%
# NBVAL_CHECK_OUTPUT
print(f"trained ReFlow, K = {cfg.marginal_steps}: every a within 1.5x of ODE-vs-ODE: {bool(learned_rows['within_1.5x'].all())}")

# %%
n_show, K = 1500, cfg.marginal_steps
x0 = torch.randn(n_show, 2, generator=torch.Generator().manual_seed(cfg.seed))
with torch.no_grad():
    ode_chain, _ = flow_sde.sample_chain(learned, x0, K, "flow_sde")
    panels = [("ODE", ode_chain)]
    for a in cfg.noise_levels:
        chain, _ = flow_sde.sample_chain(learned, x0, K, "flow_sde", a, flow_sde.full_mask(n_show, K, K),
                                         torch.Generator().manual_seed(cfg.seed + 1))
        panels.append((f"SDE a={a}", chain))
fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.2), sharex=True, sharey=True)
for ax, (name, chain) in zip(axes, panels):
    ax.scatter(*chain[:, -1].T, s=1, alpha=0.4)
    for i in range(4):  # the same four x_0 in every panel
        ax.plot(*chain[i].T, lw=1)
    ax.set_title(name)
axes[0].set_xlabel("$x_1$")
axes[0].set_ylabel("$x_2$")
fig.suptitle("same marginals, different paths (the same four x_0 in every panel)")
fig.tight_layout()
runs.save_figure(fig, run_path, "sde_vs_ode_2d")
plt.show()

# %% [markdown]
# ## 3 · Chain log-probabilities as K and a change
# The joint log-prob sums $K$ Gaussian terms. Each step's variance is $\sigma_t^2\Delta t$, so smaller $a$ or
# larger $K$ makes every term sharper (larger log-density, and larger PPO ratios for the same change in the
# mean); the spread across chains grows with $K$. The first step ($t=0$, the guarded one) carries the most noise.

# %%
lp = pd.DataFrame(pirl.log_prob_table(exact, cfg.logprob_steps, cfg.noise_levels, 2000, cfg.seed))
fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
for a, group in lp.groupby("a"):
    axes[0].plot(group.K, group.log_prob_mean, marker="o", label=f"a={a}")
    axes[1].plot(group.K, group.log_prob_std, marker="o", label=f"a={a}")
for ax, title in zip(axes, ["mean joint log-prob per chain", "std across chains"]):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("K")
    ax.set_ylabel("log-prob (nats)")
    ax.set_title(title)
    ax.legend()
fig.tight_layout()
runs.save_figure(fig, run_path, "log_prob_vs_K")
plt.show()
lp.round(2)

# %%
# NBVAL_CHECK_OUTPUT
sharper = all((g.sort_values("a").per_step_mean.diff().dropna() < 0).all() for _, g in lp.groupby("K"))
print(f"larger a -> lower log-density per step, at every K: {sharper}")

# %% [markdown]
# ## 4 · A task: the noise methods at an equal env-step budget
# Each method fine-tunes the same stage-1 checkpoint with the same PPO settings (`finetune`) and env-step
# budget, for each seed; success is the deterministic ODE chain on the same held-out seeds before and after.
# By default the task is FastReach, from the MLP clone notebook 03 starts from (made first when missing), 30
# iterations of notebook 03's tutorial settings per method: about a minute each on 2 cores.
# `params/04_flow_sde/fast_reach.yaml` runs 3 seeds for twice as long, `params/04_flow_sde/cpu.yaml` PickCube
# (docs/results/flow_sde.md). Runs are resumable: a finished `(method, seed)` is read back from its folder.

# %%
start_checkpoint("04_flow_sde", cfg)  # the default start is made when missing
first = cfg.finetune_config(cfg.methods[0], cfg.seeds[0])
env = make_env(first.env_id, first.num_envs, max_episode_steps=first.max_episode_steps, backend=first.backend)
before = pirl.evaluate_start(cfg, env, run_path)  # the ODE chain is the same for every method: once
print(f"start: success_once {before['success_once']:.2f} on {before['episodes']} held-out episodes")
results = [pirl.run_method(cfg, m, s, env, run_path, before) for m in cfg.methods for s in cfg.seeds]
env.close()
table = []
for m in cfg.methods:
    rs = [r for r in results if r["method"] == m]
    (b, _), (a, a_sd), (wt, _) = (pirl.spread([r[k] for r in rs]) for k in ("before", "after", "train_time_s"))
    table.append({"method": m, "seeds": len(rs), "env_steps": rs[0]["env_steps"], "before": b, "after": a,
                  "after_std": a_sd, "gain": a - b, "train_time_s": wt})
table = pd.DataFrame(table)
table.to_csv(run_path / "comparison.csv", index=False)
table.round(3)

# %%
# NBVAL_CHECK_OUTPUT
budget = cfg.finetune_config(cfg.methods[0], 0).total_env_steps
print(f"{len(cfg.methods)} methods x {len(cfg.seeds)} seeds ran; each met the env-step budget: "
      f"{all(r['env_steps'] >= budget for r in results)}")
print(f"every run ended above its start: {all(r['after'] > r['before'] for r in results)}")

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
for m in cfg.methods:
    curves = [pd.DataFrame(r["rows"]) for r in results if r["method"] == m]
    col = "eval/success_once" if all("eval/success_once" in c for c in curves) else "train/success_once"
    for ax, x in zip(axes, ["step", "wall_time"]):
        grid = np.linspace(0, min(c[x].max() for c in curves), 20)
        ys = np.stack([np.interp(grid, c[x], c[col].ffill().fillna(0)) for c in curves])
        ax.plot(grid, ys.mean(0), label=m)
        ax.fill_between(grid, ys.min(0), ys.max(0), alpha=0.2)
        ax.set_xlabel("env steps" if x == "step" else "wall time (s)")
        ax.set_ylabel(col)
axes[0].legend()
fig.suptitle("success during fine-tuning: mean over seeds, band = min..max")
fig.tight_layout()
runs.save_figure(fig, run_path, "comparison_curves")
plt.show()

# %%
tracker.summary({"marginal_exact": exact_rows.to_dict("records"), "marginal_reflow": learned_rows.to_dict("records"),
                 "comparison": table.to_dict("records")})
tracker.finish()
best = table.sort_values("after", ascending=False).iloc[0]
print(f"highest success after fine-tuning: {best.method} ({best.after:.2f} +- {best.after_std:.2f} over "
      f"{int(best.seeds)} seed(s)); differences smaller than the spread are not a ranking")
