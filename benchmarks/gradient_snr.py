"""How much of stage 3's policy gradient is signal, and how many decisions an update needs to see it.

Loads a ReinFlow checkpoint (its policy and its trained critic), collects ``--rollouts`` independent
rollouts of ``--decisions`` chunk decisions in each of ``--num-envs`` envs (every rollout restarts the
envs on fresh seeds), computes GAE advantages with the run's settings, normalises them over the whole
pool, and takes one policy-gradient estimate per (rollout, env) unit (``reinflow.policy_gradient``: the
gradient of the first PPO minibatch, where every ratio is 1).  The units are independent, so
``grad_signal.gram_signal`` splits the gradient into signal ``|mu|^2`` and per-unit noise, for the velocity net
(what moves the deterministic policy), each of its modules, and the noise net.  It prints the expected cosine
between the gradients of two independent batches of 64 / 256 / 1024 / 4096 / 16384 decisions and the
batch at which it reaches 1/2; a run's PPO steps are minibatches of 64-256 decisions.  Where the signal is
within 2 SE of 0 (not detected), the cosines are upper bounds and the batch a lower bound.

    .venv/bin/python benchmarks/gradient_snr.py outputs/03_reinflow/cpu_lownoise_clip_exlast_250k_s0/last.pt \\
        --rollouts 32 --name lownoise
    .venv/bin/python benchmarks/gradient_snr.py <same> -p noise_corr=0.9 --noise-std 0.2 --name corr09_std02

``-p KEY=VALUE`` changes how the same weights sample and score (``log_prob_over``, ``noise_corr``, ...);
``--noise-std`` sets ``max_noise_std`` for the rollouts (default: the run's schedule at the checkpoint).
``-p advantage=branch -p branches=2`` tries two chains per decision from one saved env state (a unit is an
env with its branches); decisions then count every branch, as their env steps do.
A per-step residual (steer ``residual_step``) is measured the same way, each env step a decision, on the
residual's mean ``mu_phi`` (the parameters either learner moves).  Its PPO checkpoint (learner ``ppo``) gives the
likelihood-ratio gradient of its Gaussian, with GAE advantages from its ``V(s)``; its TD3 checkpoint gives the
deterministic policy gradient of TD3's actor step (``residual_td3.actor_loss``, through the trained ``Q_1``) on the
states of the same kind of rollouts, exploration included.  One is the gradient each learner steps along, so the
two tell how many decisions each needs for an update that points somewhere (the DPG's bias, if its critic is wrong,
is not what this measures)::

    .venv/bin/python benchmarks/gradient_snr.py outputs/03_reinflow/step_ppo_s0/last.pt --name step_ppo_s0
    .venv/bin/python benchmarks/gradient_snr.py outputs/03_reinflow/cpu_s0/last.pt --name td3_s0

Rollouts pay the run's learning reward (``loop.learning_runner``).
Writes ``outputs/benchmarks/gradient_snr/<name>.json``.
"""
from __future__ import annotations

import argparse
import time

import torch
from tqdm import tqdm

from flowlib.envs.maniskill import make_env
from flowlib.flows.flow_sde import LEARNED_NOISE
from flowlib.infra import grad_signal
from flowlib.infra.runs import run_dir, save_json
from flowlib.methods import reinflow, residual_step, residual_td3, stage3
from flowlib.rl import loop, ppo
from flowlib.tools.run import parse_overrides

BATCHES = (64, 256, 1024, 4096, 16384)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a ReinFlow last.pt / best_model.pt (its critic gives the advantages)")
    ap.add_argument("--rollouts", type=int, default=16)
    ap.add_argument("--decisions", type=int, default=0, help="decisions per env per rollout (0: the run's rollout_steps)")
    ap.add_argument("--num-envs", type=int, default=8)
    ap.add_argument("--noise-std", type=float, default=0.0, help="max_noise_std of the rollouts (0: the run's schedule)")
    ap.add_argument("-p", "--param", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--seed", type=int, default=5_000_000, help="first env seed (away from training and evaluation)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--name", default="default")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    overrides = parse_overrides(args.param)
    ckpt, cfg, agent, std = stage3.load_for_rollouts(args.checkpoint, overrides, args.noise_std)
    per_step = isinstance(agent, residual_step.StepResidualAgent)  # each env step a decision
    td3 = per_step and cfg.learner == "td3"
    T = args.decisions or cfg.rollout_steps * (agent.act_horizon if per_step else 1)  # as an iteration of the run
    if per_step:
        how = f"steer residual_step, learner {cfg.learner}; exploration std {std:.3f}"
    else:
        noise = (f"max_noise_std {std:.3f}; noise_corr {cfg.noise_corr}" if cfg.noise_method in LEARNED_NOISE
                 else f"noise_level {cfg.noise_level}")
        how = (f"{cfg.noise_method}{' + hybrid' if cfg.hybrid else ''}; {noise}; K = {agent.K}; "
               f"log_prob_over {cfg.log_prob_over}")
    print(f"{args.checkpoint} at {ckpt['env_steps']} env steps; {how}; reward {cfg.reward}")

    # --- rollouts: one unit = one env's T decisions in one rollout
    t0, gen, pool = time.time(), torch.Generator().manual_seed(args.seed), []
    with make_env(cfg.env_id, args.num_envs, max_episode_steps=cfg.max_episode_steps) as env:
        runner = loop.learning_runner(cfg, env, agent.obs_horizon, args.seed)
        collector = residual_step.StepCollector(agent, runner, gen, n_step=0) if per_step else None
        for _ in tqdm(range(args.rollouts), desc="rollouts", mininterval=10):
            runner.restart()
            if td3:  # the states TD3's actor step would sample from its replay
                pool.append(collector.steps(T)[0])
                continue
            buf = collector.rollout(T) if per_step else reinflow.collect(agent, runner, T, gen, branches=cfg.branches)
            advantages, returns = buf.advantages(cfg)
            pool.append((buf, advantages, returns))
    episodes = runner.pop_finished()
    rollout_s = time.time() - t0
    ev = None
    if not td3:
        adv = torch.stack([a for _, a, _ in pool])                             # [R, T, N]
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)                          # as ppo_update's norm_adv
        values = torch.cat([b.values.flatten() for b, _, _ in pool])
        ev = ppo.explained_variance(values, torch.cat([r.flatten() for _, _, r in pool]))

    M = cfg.branches
    C = T * M  # chunks executed per unit: with branches, every try of a decision costs its env steps
    # --- one gradient per unit; Gram matrices per module of the velocity net and for the noise net
    # (the parameters PPO moves: a frozen obs_encoder is left out), or of the per-step residual's mean
    if per_step:
        parts = {"residual": agent.policy_parameters()}
    elif not hasattr(agent, "actor"):  # a chunk steer of the frozen flow: its head
        parts = {"head": agent.policy_parameters()}
    else:
        parts = {f"velocity.{name}": [p for p in m.parameters() if p.requires_grad]
                 for name, m in agent.actor.base.named_children()}
        parts = {name: params for name, params in parts.items() if params}
        parts["noise"] = list(agent.actor.noise_net.parameters())
    counts = {name: sum(p.numel() for p in params) for name, params in parts.items()}
    params = [p for ps in parts.values() for p in ps]
    scorer = agent.ppo_view() if per_step and not td3 else agent  # what ppo_update scores with (not TD3)

    def unit_gradient(r: int, i: int) -> torch.Tensor:  # [P]: rollout r's env i (with its branches)
        if td3:
            s = agent.state(pool[r]["obs"][:, i], pool[r]["base"][:, i])                  # [T, S]
            loss, _ = residual_td3.actor_loss(agent, s, cfg.residual_l2)
            return torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])
        buf = pool[r][0]
        cols = [i + m * args.num_envs for m in range(M)]  # env i and its branches (column m * N + i)
        return reinflow.policy_gradient(scorer, buf.obs[:, cols].flatten(0, 1), buf.chains[:, cols].flatten(0, 1),
                                        buf.stochastic[:, cols].flatten(0, 1), adv[r][:, cols].flatten(), params)

    rows = {k: [] for k in parts}
    t1 = time.time()
    for r in tqdm(range(len(pool)), desc="gradients", mininterval=10):
        for i in range(args.num_envs):
            for name, part in zip(parts, unit_gradient(r, i).split(list(counts.values()))):
                rows[name].append(part)
    grams = {}
    for name in list(rows):
        g = torch.stack(rows.pop(name))                                        # [units, P_part]
        grams[name] = g @ g.T
    velocity = [k for k in parts if k.startswith("velocity.")]
    if velocity:
        grams = {"velocity": sum(grams[k] for k in velocity), **grams}
        counts = {"velocity": sum(counts[k] for k in velocity), **counts}
    grad_s = time.time() - t1

    result = {"checkpoint": args.checkpoint, "env_steps": ckpt["env_steps"], "max_noise_std": std, "K": agent.K,
              "steer": cfg.steer, "learner": cfg.learner, "overrides": overrides, "units": len(pool) * args.num_envs,
              "decisions_per_unit": C,
              "branches": M, "decisions": len(pool) * args.num_envs * C, "explained_variance": ev, "rollout_s": rollout_s,
              "gradient_s": grad_s, "episodes": len(episodes),
              "train_success_once": sum(e["success_once"] for e in episodes) / max(len(episodes), 1)}
    print(f"{result['decisions']} decisions ({result['units']} units of {C}) in {rollout_s:.0f} s; "
          f"{len(episodes)} episodes, success_once {result['train_success_once']:.2f}"
          + ("" if ev is None else f"; explained variance {ev:.2f}"))
    print(f"{'params of':>17} {'count':>8} {'signal |mu|^2':>14} {'+- SE':>9} {'noise / unit':>12} "
          + " ".join(f"{'cos@' + str(b):>9}" for b in BATCHES) + f" {'decisions for cos 1/2':>22}")
    for name, gram in grams.items():
        if not gram.diagonal().any():  # e.g. the noise net under flow_sde, whose noise is a fixed schedule
            print(f"{name:>17} {counts[name]:>8}  not in the log-prob (zero gradient)")
            continue
        s = grad_signal.gram_signal(gram)  # not detected: the cosines are upper bounds, the decisions a lower bound
        s["params"] = counts[name]
        s["decisions_for_half"] = s["noise"] / s["signal_bound"] * C
        s["cosine"] = {b: grad_signal.expected_cosine(s["signal_bound"], s["noise"], b / C) for b in BATCHES}
        result[name] = s
        mark = "" if s["detected"] else "<"
        print(f"{name:>17} {counts[name]:>8} {s['signal']:>14.3e} {s['signal_se']:>9.1e} {s['noise']:>12.3e} "
              + " ".join(f"{mark + format(c, '.3f'):>9}" for c in s["cosine"].values())
              + f" {('>' if mark else '') + format(s['decisions_for_half'], '.0f'):>22}")
    print("< and >: no signal detected (|mu|^2 within 2 SE of 0); bounds from |mu|^2 + 2 SE")
    path = run_dir("benchmarks", "gradient_snr") / f"{args.name}.json"
    save_json(path, result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
