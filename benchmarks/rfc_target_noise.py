"""How far a few reflow steps move a flow policy, by what the chunks it is reflowed on carry: demos, its own ODE
chunks, or its own noisy-chain chunks at a given noise level.

Not a learner: a diagnostic of RFC (``flowlib.methods.rfc``) that needs no simulator. From a stage-1 checkpoint it builds
RFC's agent (a params file's chain: K, noise bounds) and, for each target source, takes ``--steps`` Adam steps of
stage 1's ShortCut loss (``flowlib.methods.rfc.RFCLearner.flow``, the live net, at ``--lr``) on ``--windows`` demo
observation windows, with as targets

* ``demos``: the demonstrations' own chunks (what stage 1 fitted);
* ``ode``: the policy's deterministic chain end ``x_K`` on those windows (self-distillation: should not move);
* ``chain s``: its noisy chain's ``x_K`` at ``max_noise_std = s``, what RFC's rollouts store and reflow.

It reports, on 512 other demo windows with fixed ``x_0`` draws, the drift of the deterministic executed chunk from
the start's (mean squared, normalised action units) and its error against the demos' executed actions. Every source
is reflowed from the same weights, minibatches and loss draws, so the rows differ only in the targets; every row's mask
keeps all windows (RFC's masks choose which of the chunks, not what they carry).

    .venv/bin/python benchmarks/rfc_target_noise.py --params params/06_steering/pickcube_rfc/success_only.yaml \\
        --std 0.2 0.05 --name pickcube_state_cpu
"""
from __future__ import annotations

import argparse
import copy

import torch

from flowlib.infra import config
from flowlib.infra.runs import run_dir, save_json
from flowlib.methods import stage3
from flowlib.methods.rfc import RFCLearner
from flowlib.policies import bc


def deterministic_chunks(agent, obs_n: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """``x_K [B, H, A]`` of the ODE (no chain noise) from ``x0``, on normalised windows ``obs_n [B, To, O]``."""
    with torch.no_grad():
        return agent.ode_chunk(agent.obs_normalizer.unnormalize(obs_n), x0)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="params/06_steering/pickcube_rfc/success_only.yaml",
                    help="an RFC params file (its init_checkpoint, chain and minibatch size)")
    ap.add_argument("--std", type=float, nargs="+", default=[0.2, 0.05], help="noise levels of the chain rows")
    ap.add_argument("--lr", type=float, default=None, help="default: the params file's actor_lr")
    ap.add_argument("--steps", type=int, default=16, help="Adam steps per row (RFC on PickCube: ~4-8 per iteration)")
    ap.add_argument("--windows", type=int, default=256, help="demo windows the rows reflow on")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="default", help="outputs/benchmarks/rfc_target_noise/<name>.json")
    args = ap.parse_args(argv)

    cfg = config.from_yaml(stage3.SteeringConfig, args.params)
    if args.lr is not None:
        cfg.actor_lr = args.lr
    path = stage3.init_checkpoint_path(cfg)
    torch.manual_seed(args.seed)
    start, _ = stage3.build_agent(cfg, path)
    obs_n, act_n = bc.training_windows(path, start)  # [N, To, O], [N, H, A]
    gen = torch.Generator().manual_seed(args.seed)
    perm = torch.randperm(len(obs_n), generator=gen)
    ev, tr = perm[:512], perm[512:512 + args.windows]
    x0 = torch.randn(len(ev), start.pred_horizon, start.action_dim, generator=gen)
    ex = slice(start.obs_horizon - 1, start.obs_horizon - 1 + start.act_horizon)  # the executed actions of a chunk
    ref = deterministic_chunks(start, obs_n[ev], x0)
    base_err = float((ref[:, ex] - act_n[ev, ex]).pow(2).mean())
    batches = [torch.randint(len(tr), (cfg.minibatch_size,), generator=gen) for _ in range(args.steps)]

    def targets(source: str, std: float) -> torch.Tensor:
        if source == "demos":
            return act_n[tr]
        if source == "ode":
            return deterministic_chunks(start, obs_n[tr], torch.randn(len(tr), *x0.shape[1:], generator=gen))
        agent = copy.deepcopy(start)
        agent.set_max_noise_std(std)
        with torch.no_grad():  # the agent normalises raw windows itself
            chain, _ = agent.sample(agent.obs_normalizer.unnormalize(obs_n[tr]), generator=gen)
        return chain[:, -1]

    rows = [("demos", 0.0), ("ode", 0.0), *[("chain", s) for s in args.std]]
    print(f"start {path}: executed-chunk error against the demos {base_err:.4f}; {args.steps} Adam steps at lr "
          f"{cfg.actor_lr:g}, minibatches of {cfg.minibatch_size} from {len(tr)} windows")
    print(f"{'targets':>12} | {'reflow loss':>11} | {'drift':>7} | {'demo error':>10}")
    out = {"checkpoint": str(path), "lr": cfg.actor_lr, "steps": args.steps, "start_error": base_err, "rows": []}
    for source, std in rows:
        agent = copy.deepcopy(start)
        learner = RFCLearner(agent, cfg)
        learner.build_optimizers()
        y, o = targets(source, std), obs_n[tr].clamp(-agent.obs_clip, agent.obs_clip)
        torch.manual_seed(args.seed)  # the loss's own draws (t, noise) the same in every row
        losses = []
        for b in batches:
            loss, _ = learner.flow.loss(y[b], obs=o[b])
            learner.actor_opt.zero_grad(set_to_none=True)
            loss.backward()
            learner.actor_opt.step()
            losses.append(loss.item())
        x = deterministic_chunks(agent, obs_n[ev], x0)
        row = {"targets": source if source != "chain" else f"chain {std:g}", "loss": sum(losses) / len(losses),
               "drift": float((x - ref)[:, ex].pow(2).mean()), "demo_error": float((x[:, ex] - act_n[ev, ex]).pow(2).mean())}
        out["rows"].append(row)
        print(f"{row['targets']:>12} | {row['loss']:>11.3f} | {row['drift']:>7.4f} | {row['demo_error']:>10.4f}")
    save_json(run_dir("benchmarks", "rfc_target_noise") / f"{args.name}.json", out)
    return out


if __name__ == "__main__":
    main()
