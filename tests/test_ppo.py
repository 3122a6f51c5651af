"""The PPO toolkit: advantage estimators against each other and by hand, GRPO groups, dual clip,
Huber value clipping, the two ratio formulations, and the critic on the velocity net's features."""
import math

import pytest
import torch
from test_flow_sde import agent_for

from flowlib.infra import grad_signal
from flowlib.methods import reinflow, stage3
from flowlib.rl import advantages, ppo


def rollout(T=6, N=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    rewards, values, next_values = (torch.rand(T, N, generator=g) for _ in range(3))
    discounts = 0.99 ** torch.randint(1, 9, (T, N), generator=g).float()
    terminal = torch.zeros(T, N, dtype=torch.bool)
    ends = torch.zeros(T, N, dtype=torch.bool)
    terminal[1, 0] = ends[1, 0] = True      # a termination mid-rollout
    ends[3, 1] = True                       # a truncation (bootstraps)
    terminal[4, 2] = ends[4, 2] = True
    # as in a rollout: the value after a decision is the next decision's value unless the episode ended
    next_values[:-1] = torch.where(ends[:-1], next_values[:-1], values[1:])
    return rewards, values, next_values, discounts, terminal, ends


def test_gae_at_lambda_one_equals_mc_returns_minus_values():
    R, V, V_next, disc, term, ends = rollout()
    adv, ret = advantages.gae(R, V, V_next, disc, term, ends, lam=1.0)
    mc = advantages.mc_returns(R, V_next, disc, term, ends)
    assert torch.allclose(adv, mc - V, atol=1e-6) and torch.allclose(ret, mc, atol=1e-6)
    # by hand, env 0 (terminates at t=1): G_1 = R_1, G_0 = R_0 + g_0 R_1
    assert torch.isclose(mc[0, 0], R[0, 0] + disc[0, 0] * R[1, 0])
    # env 1 truncates at t=3: G_3 = R_3 + g_3 V(s')
    assert torch.isclose(mc[3, 1], R[3, 1] + disc[3, 1] * V_next[3, 1])


def test_nstep_is_td0_at_one_and_mc_beyond_the_rollout():
    R, V, V_next, disc, term, ends = rollout()
    td0 = R + disc * (~term).float() * V_next
    assert torch.allclose(advantages.nstep_returns(R, V_next, disc, term, ends, 1), td0, atol=1e-6)
    assert torch.allclose(advantages.nstep_returns(R, V_next, disc, term, ends, 50),
                          advantages.mc_returns(R, V_next, disc, term, ends), atol=1e-6)
    two = advantages.nstep_returns(R, V_next, disc, term, ends, 2)
    # env 2, t=2: no end at t=2, so R_2 + g_2 R_3 + g_2 g_3 V(s_4)
    assert torch.isclose(two[2, 2], R[2, 2] + disc[2, 2] * R[3, 2] + disc[2, 2] * disc[3, 2] * V_next[3, 2])
    with pytest.raises(ValueError, match="n_step"):
        advantages.nstep_returns(R, V_next, disc, term, ends, 0)


def test_grpo_advantages_have_zero_mean_and_unit_spread_per_group():
    scores = torch.tensor([1.0, 0.0, 0.0, 0.9, 0.5, 0.5, 3.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2])
    adv = advantages.grpo_advantages(scores, groups)
    for g in (0, 1):
        assert abs(float(adv[groups == g].mean())) < 1e-6
    assert torch.isclose(adv[groups == 0].std(), torch.tensor(1.0), atol=1e-4)
    assert adv[-1] == 0  # a group of one has no baseline
    assert adv[0] > 0 > adv[1]


def test_branch_advantages_are_leave_one_out_and_cancel_what_the_branches_share():
    q = torch.tensor([[1.0, 5.0], [3.0, 5.0], [8.0, 2.0]])            # [M = 3 branches, 2 states]
    adv = advantages.branch_advantages(q)
    assert torch.allclose(adv[:, 0], torch.tensor([1 - 5.5, 3 - 4.5, 8 - 2.0]))
    assert torch.allclose(adv[:, 1], torch.tensor([5 - 3.5, 5 - 3.5, 2 - 5.0]))
    shifted = advantages.branch_advantages(q + torch.tensor([100.0, -7.0]))   # a per-state offset (V(s), its error)
    assert torch.allclose(shifted, adv)
    assert torch.allclose(advantages.branch_advantages(q[:2]), torch.tensor([[-2.0, 0.0], [2.0, 0.0]]))
    with pytest.raises(ValueError, match=">= 2 branches"):
        advantages.branch_advantages(q[:1])


def test_dual_clip_bounds_the_loss_for_negative_advantages():
    ratio = torch.tensor([0.5, 1.0, 2.0, 10.0, 100.0])
    adv = -torch.ones(5)
    plain = ppo.clipped_surrogate(ratio, adv, 0.2)
    dual = ppo.clipped_surrogate(ratio, adv, 0.2, dual_clip=3.0)
    assert plain[-1] == 100.0 and (dual <= 3.0).all() and dual[-1] == 3.0
    assert torch.equal(dual[:3], plain[:3])  # below the cap nothing changes
    pos = ppo.clipped_surrogate(ratio, -adv, 0.2, dual_clip=3.0)
    assert torch.equal(pos, ppo.clipped_surrogate(ratio, -adv, 0.2))  # positive advantages untouched
    with pytest.raises(ValueError, match="dual_clip"):
        ppo.clipped_surrogate(ratio, adv, 0.2, dual_clip=0.5)


def test_huber_value_loss_with_clipping():
    v, old, G = torch.tensor([3.0, 0.1]), torch.tensor([0.0, 0.0]), torch.tensor([0.0, 0.0])
    assert torch.allclose(ppo.value_loss(v, old, G, huber_delta=1.0), torch.tensor([2.5, 0.005]))
    assert torch.allclose(ppo.value_loss(v, old, G), torch.tensor([4.5, 0.005]))
    # clipped to old +- 0.5: the max of the two losses keeps the larger (unclipped) one here
    assert torch.allclose(ppo.value_loss(v, old, G, clip=0.5, huber_delta=1.0), torch.tensor([2.5, 0.005]))
    G2 = torch.tensor([3.0, 0.0])
    assert torch.allclose(ppo.value_loss(v, old, G2, clip=0.5), torch.tensor([0.5 * 2.5 ** 2, 0.005]))


def batch_of(agent, obs):
    chain, log_prob, stochastic, step_lp = agent.sample(obs, torch.Generator().manual_seed(3), return_steps=True)
    n = len(obs)
    return {"obs": obs, "chains": chain, "log_probs": log_prob, "stochastic": stochastic, "step_log_probs": step_lp,
            "values": torch.zeros(n), "advantages": torch.linspace(-1, 1, n), "returns": torch.randn(n)}


def one_update(agent, batch, **cfg_kw):
    cfg = stage3.Stage3Config(minibatch_size=len(batch["obs"]), update_epochs=1, adv_norm="off", **cfg_kw)
    opt_a = torch.optim.SGD(agent.policy_parameters(), 1e-2)
    opt_c = torch.optim.SGD(agent.value_parameters(), 1e-2)
    return ppo.ppo_update(agent, batch, opt_a, opt_c, cfg)


@pytest.mark.slow
def test_with_one_stochastic_step_the_joint_and_per_step_ratios_give_the_same_update():
    results = []
    for mode in ("joint", "per_step"):
        agent, obs = agent_for("flow_sde", hybrid=True)
        stats = one_update(agent, batch_of(agent, obs), ratio_mode=mode)
        results.append((stats["policy_loss"], [p.detach().clone() for p in agent.policy_parameters()]))
    assert abs(results[0][0] - results[1][0]) < 1e-6
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(results[0][1], results[1][1]))
    # both formulations check that every ratio starts at 1
    for mode in ("joint", "per_step"):
        agent, obs = agent_for("flow_sde")
        batch = batch_of(agent, obs)
        batch["step_log_probs"] = batch["step_log_probs"] - 0.05 * torch.arange(4.0)  # as after some updates
        batch["log_probs"] = batch["log_probs"] - 0.3
        with pytest.raises(RuntimeError, match="not 1"):
            one_update(agent, batch, ratio_mode=mode)


def test_zero_weight_rows_do_not_move_the_policy():
    agent, obs = agent_for("reinflow")
    batch = batch_of(agent, obs)
    batch["weights"] = torch.zeros(len(obs))
    before = [p.detach().clone() for p in agent.policy_parameters()]
    one_update(agent, batch)
    assert all(torch.equal(a, b) for a, b in zip(before, agent.policy_parameters()))


@pytest.mark.parametrize("detach", [True, False])
def test_critic_on_velocity_features_and_its_detach(detach):
    agent, obs = agent_for("flow_sde", critic_input="velocity_features", detach_critic_input=detach)
    value = agent.value(obs)
    assert value.shape == (6,)
    value.sum().backward()
    base_grads = [p.grad for p in agent.actor.base.parameters()]
    touched = any(g is not None and g.abs().sum() > 0 for g in base_grads)
    assert touched is (not detach)
    assert all(p.grad is not None for p in agent.value_parameters())


def bandit_fine_tune(method, sign=1.0, iterations=20):
    """PPO through the noisy chain on a one-step bandit: r = -mean (a - 0.5)^2 over the executed actions.
    Returns the deterministic chain's mean reward before and after (same x_0 draws)."""
    torch.manual_seed(0)
    agent, obs = agent_for(method, log_prob_over="executed")
    obs = obs.repeat(4, 1, 1)                                                # [24, To, O]
    reward = lambda chain: -((agent.actions(chain) - 0.5) ** 2).mean((1, 2))  # [B]
    cfg = stage3.Stage3Config(minibatch_size=len(obs), update_epochs=4, ent_coef=0.0)
    opt_a = torch.optim.Adam(agent.policy_parameters(), 3e-3)
    opt_c = torch.optim.Adam(agent.value_parameters(), 1e-2)
    gen = torch.Generator().manual_seed(1)
    det = lambda: reward(agent.sample(obs, torch.Generator().manual_seed(9), deterministic=True)[0]).mean().item()
    before = det()
    for _ in range(iterations):
        agent.eval()
        chain, log_prob, stochastic, step_lp = agent.sample(obs, gen, return_steps=True)
        r, values = reward(chain), agent.value(obs).detach()
        batch = {"obs": obs, "chains": chain, "log_probs": log_prob, "stochastic": stochastic, "step_log_probs": step_lp,
                 "values": values, "advantages": sign * (r - values), "returns": r}
        agent.train()
        ppo.ppo_update(agent, batch, opt_a, opt_c, cfg)
    agent.eval()
    return before, det()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["reinflow", "flow_sde"])
def test_ppo_through_the_chain_raises_a_bandits_reward_and_a_flipped_advantage_lowers_it(method):
    before, after = bandit_fine_tune(method)
    assert after > before + 0.04, (before, after)
    before, after = bandit_fine_tune(method, sign=-1.0)  # the control: the same update, uphill on -A
    assert after < before - 0.04, (before, after)


def test_kl_stop_policy_freezes_the_policy_where_all_stops_and_keeps_fitting_the_value():
    """Past target_kl, "all" ends the update (value included); "policy" moves the policy exactly as
    "all" does, then spends the remaining epochs on the value alone."""
    out = {}
    for mode in ("all", "policy"):
        agent, obs = agent_for("reinflow")
        batch = batch_of(agent, obs)                                          # 6 decisions
        cfg = stage3.Stage3Config(minibatch_size=3, update_epochs=3, adv_norm="off", target_kl=1e-12, kl_stop=mode)
        opt_a = torch.optim.SGD(agent.policy_parameters(), 1e-1)
        opt_c = torch.optim.SGD(agent.value_parameters(), 1e-2)
        value_before = torch.nn.functional.mse_loss(agent.value(obs), batch["returns"]).item()
        stats = ppo.ppo_update(agent, batch, opt_a, opt_c, cfg, generator=torch.Generator().manual_seed(0))
        value_after = torch.nn.functional.mse_loss(agent.value(obs), batch["returns"]).item()
        out[mode] = (stats, [p.detach().clone() for p in agent.policy_parameters()], value_before, value_after)
    (s_all, pol_all, v0, v_all), (s_pol, pol_pol, _, v_pol) = out["all"], out["policy"]
    # the first minibatch has ratio 1 (KL 0); the second one's KL > 1e-12 stops the policy
    assert s_all["kl_early_stop"] == s_pol["kl_early_stop"] == 1.0
    assert s_all["epochs"] == 1 and s_pol["epochs"] == 3
    assert s_all["policy_steps"] == s_pol["policy_steps"] == 2
    assert all(torch.equal(a, b) for a, b in zip(pol_all, pol_pol))         # same policy steps, then frozen
    assert v_pol < v_all < v0                                                 # 6 value steps beat 2
    with pytest.raises(ValueError, match="kl_stop must be 'all' or 'policy'"):
        stage3.Stage3Config(kl_stop="value")


def test_policy_epochs_moves_the_policy_in_the_first_epochs_only_and_the_value_in_all():
    """policy_epochs = 1 of 3: the policy ends where a one-epoch update leaves it (same minibatch order),
    and the value takes all three epochs' steps."""
    out = {}
    for epochs, policy_epochs in ((1, 0), (3, 1), (3, 0)):
        agent, obs = agent_for("reinflow")
        batch = batch_of(agent, obs)                                          # 6 decisions
        cfg = stage3.Stage3Config(minibatch_size=3, update_epochs=epochs, policy_epochs=policy_epochs,
                                      adv_norm="off")
        opt_a = torch.optim.SGD(agent.policy_parameters(), 1e-1)
        opt_c = torch.optim.SGD(agent.value_parameters(), 1e-2)
        stats = ppo.ppo_update(agent, batch, opt_a, opt_c, cfg, generator=torch.Generator().manual_seed(0))
        value_loss = torch.nn.functional.mse_loss(agent.value(obs), batch["returns"]).item()
        out[epochs, policy_epochs] = ([p.detach().clone() for p in agent.policy_parameters()], value_loss)
        assert stats["policy_steps"] == 2 * (policy_epochs or epochs)  # 2 minibatches per epoch
    (one, v_one), (split, v_split), (every, _) = out[1, 0], out[3, 1], out[3, 0]
    assert all(torch.equal(a, b) for a, b in zip(one, split))                # one epoch of policy steps
    assert not all(torch.equal(a, b) for a, b in zip(one, every))            # three epochs move it further
    assert v_split < v_one                                                   # 6 value steps beat 2
    with pytest.raises(ValueError, match="policy_epochs must be in"):
        stage3.Stage3Config(update_epochs=2, policy_epochs=3)


def test_policy_gradient_is_the_first_ppo_step():
    """The gradient the SNR benchmark measures is the one PPO's first minibatch steps along (SGD, no clipping)."""
    agent, obs = agent_for("reinflow")
    batch = batch_of(agent, obs)
    params = agent.policy_parameters()
    grad = reinflow.policy_gradient(agent, obs, batch["chains"], batch["stochastic"], batch["advantages"], params)
    before = torch.cat([p.detach().flatten() for p in params])
    one_update(agent, batch, ent_coef=0.0, max_grad_norm=1e9)                   # SGD, lr 1e-2
    after = torch.cat([p.detach().flatten() for p in params])
    assert grad.abs().max() > 0
    step = 1e-2 * grad
    # float32 rounding of before - step is ~1e-7 |before|: compare to the step's own size, not to 1e-6 flat
    assert (after - (before - step)).abs().max() < 1e-7 * before.abs().max() + 1e-4 * step.abs().max()


def test_gradient_signal_recovers_signal_noise_and_the_batch_for_cosine_one_half():
    g = torch.Generator().manual_seed(0)
    P, n, s = 200, 400, 20.0
    mu = torch.randn(P, generator=g)
    mu = mu / mu.norm()                                                       # |mu|^2 = 1
    draw = lambda rows: mu + (s / P) ** 0.5 * torch.randn(rows, P, generator=g)  # noise trace s per row
    est = grad_signal.gradient_signal(draw(n))
    assert abs(est["signal"] - 1.0) < 3 * est["signal_se"] and est["signal_se"] < 0.2
    assert abs(est["noise"] - s) < 0.05 * s
    assert abs(est["rows_for_half"] - s) < 0.3 * s
    assert est["detected"] and est["signal_bound"] == est["signal"]
    # the predicted cosine between two independent means of m rows against the measured one
    m = 20
    cos = [torch.cosine_similarity(draw(m).mean(0), draw(m).mean(0), 0).item() for _ in range(300)]
    assert abs(sum(cos) / len(cos) - grad_signal.expected_cosine(1.0, s, m)) < 0.03
    assert grad_signal.expected_cosine(1.0, s, m) == 0.5
    # Gram matrices of disjoint parameter groups add up to the whole's
    rows = draw(n)
    halves = grad_signal.gram_signal(rows[:, :P // 2] @ rows[:, :P // 2].T + rows[:, P // 2:] @ rows[:, P // 2:].T)
    assert halves["signal"] == pytest.approx(grad_signal.gradient_signal(rows)["signal"], rel=1e-6)
    # no signal: the estimate is within noise of 0
    noise_only = grad_signal.gradient_signal(draw(n) - mu)
    assert abs(noise_only["signal"]) < 3 * noise_only["signal_se"]
    assert not noise_only["detected"] and noise_only["signal_bound"] >= 2 * noise_only["signal_se"] > 0  # covers 0
    with pytest.raises(ValueError, match="n >= 3"):
        grad_signal.gradient_signal(torch.zeros(2, P))


@pytest.mark.parametrize("ratio_mode, hybrid", [("joint", False), ("per_step", True)])
def test_micro_batches_give_the_same_update_as_one_pass(ratio_mode, hybrid):
    """Gradient accumulation over slices of 2 rows (one dropped by a zero weight) takes the same optimiser steps and
    reports the same statistics as the whole minibatch in one pass; a negative size is rejected."""
    out = {}
    for micro in (0, 2):
        agent, obs = agent_for("flow_sde", hybrid=hybrid)
        batch = batch_of(agent, obs) | {"weights": torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0])}  # 6 decisions
        cfg = stage3.Stage3Config(minibatch_size=6, micro_batch_size=micro, update_epochs=3, ratio_mode=ratio_mode)
        opt_a = torch.optim.SGD(agent.policy_parameters(), 1e-1)
        opt_c = torch.optim.SGD(agent.value_parameters(), 1e-2)
        stats = ppo.ppo_update(agent, batch, opt_a, opt_c, cfg, generator=torch.Generator().manual_seed(0))
        out[micro] = [p.detach().clone() for p in agent.parameters()], stats
    (whole, s_whole), (sliced, s_sliced) = out[0], out[2]
    assert s_whole["approx_kl"] > 0 and s_whole["policy_steps"] == 3                 # the policy did move
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(whole, sliced))
    for k in ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_frac"):
        assert s_sliced[k] == pytest.approx(s_whole[k], rel=1e-4, abs=1e-6), k
    with pytest.raises(ValueError, match="'micro_batch_size' = -1: should be greater than or equal to 0"):
        stage3.Stage3Config(micro_batch_size=-1)


def test_a_nan_return_stops_the_update_before_it_touches_the_weights():
    """A NaN reaching the value loss would, once clipped, turn every weight NaN; the update raises instead, naming
    the net, the minibatch and the fix, and leaves both nets as they were."""
    agent, obs = agent_for("reinflow")
    batch = batch_of(agent, obs)
    batch["returns"][3] = float("nan")
    before = [p.detach().clone() for p in agent.parameters()]
    with pytest.raises(FloatingPointError, match=r"value net's gradient norm is nan at epoch 0, minibatch 0: lower critic_lr"):
        one_update(agent, batch)
    assert all(torch.equal(a, b) for a, b in zip(before, agent.parameters()))


def test_the_running_reward_scaler_divides_by_the_std_of_the_discounted_return_and_restarts_at_episode_ends():
    """One env, rewards 1 with a discount of 0.5 per decision, an episode end after decision 2: the running returns
    are 1, 1.5, 1.75, then 1, 1.5 again; the rewards come back divided by the std of those five (the count-1e-4 prior
    moves it by less than 1e-3), and a scaler restored from its state_dict scales the next rollout the same way."""
    rewards, discounts = torch.ones(5, 1), torch.full((5, 1), 0.5)
    ends = torch.tensor([[False], [False], [True], [False], [False]])
    scaler = advantages.RunningRewardScaler()
    scaled = scaler(rewards, discounts, ends)
    G = torch.tensor([1.0, 1.5, 1.75, 1.0, 1.5], dtype=torch.float64)
    assert abs(scaler.var - G.var(unbiased=False).item()) < 1e-3 and abs(scaler.mean - G.mean().item()) < 1e-3
    assert torch.allclose(scaled, rewards / math.sqrt(scaler.var + 1e-8))
    assert scaler.returns.tolist() == [0.5 * 1.5]  # carried into the next rollout, discounted
    twin = advantages.RunningRewardScaler()
    twin.load_state_dict(scaler.state_dict())
    more = torch.tensor([[2.0], [0.0]])
    assert torch.equal(scaler(more, discounts[:2], ends[:2]), twin(more, discounts[:2], ends[:2]))
    big = advantages.RunningRewardScaler(clip=1.0)
    assert big(torch.tensor([[100.0], [0.0]]), discounts[:2], ends[:2]).max() == 1.0  # clipped at +-clip


def test_the_w2_regulariser_is_zero_at_the_start_and_holds_ppo_near_it():
    """ReinFlow's BC term: 0 at the start policy (its ODE chunk is the deterministic sample's), positive once PPO
    has moved the velocity net, and with a large weight the same PPO updates stay closer to the start."""
    import copy
    agent, obs = agent_for("reinflow", log_prob_over="executed")
    x0 = torch.randn(len(obs), agent.pred_horizon, agent.action_dim, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.allclose(agent.ode_chunk(obs, x0), agent.sample(obs, deterministic=True, x0=x0)[0][:, -1],
                              atol=1e-6)
    start = copy.deepcopy(agent)
    assert torch.equal(reinflow.W2Regulariser(agent, start, 1.0).distance(obs), torch.zeros(len(obs)))

    def distance_after_ppo(coeff):
        torch.manual_seed(0)
        moved = copy.deepcopy(agent)  # the start, trainable (the regulariser froze its own copy)
        reg = reinflow.W2Regulariser(moved, start, coeff)
        reward = lambda chain: -((moved.actions(chain) - 0.5) ** 2).mean((1, 2))
        cfg = stage3.Stage3Config(minibatch_size=len(obs), update_epochs=4, ent_coef=0.0)
        opt_a = torch.optim.Adam(moved.policy_parameters(), 3e-3)
        opt_c = torch.optim.Adam(moved.value_parameters(), 1e-2)
        gen = torch.Generator().manual_seed(1)
        for _ in range(10):
            chain, log_prob, stochastic, step_lp = moved.sample(obs, gen, return_steps=True)
            r = reward(chain)
            batch = {"obs": obs, "chains": chain, "log_probs": log_prob, "stochastic": stochastic,
                     "step_log_probs": step_lp, "values": torch.zeros(len(obs)), "advantages": r - r.mean(),
                     "returns": r}
            stats = ppo.ppo_update(moved, batch, opt_a, opt_c, cfg, generator=gen, regularisers=[reg] if coeff else [])
            assert ("bc_loss" in stats) == bool(coeff)
        with torch.no_grad():
            w2 = reinflow.W2Regulariser(moved, start, 1.0)
            return w2.distance(obs, torch.Generator().manual_seed(2)).mean().item()

    free, held = distance_after_ppo(0.0), distance_after_ppo(100.0)
    assert free > 1e-2 and held < 0.5 * free, (free, held)  # measured: 0.129 and 0.047


def test_adv_norm_standardises_over_the_batch_per_minibatch_or_not_at_all():
    """``adv_norm``: "batch" standardises the advantages once over the live rows; "minibatch" within each minibatch,
    which is the same update when one minibatch holds the whole batch and another when it does not; "off" uses them
    as given, so it equals "batch" on advantages already standardised."""
    import copy

    from test_flow_sde import agent_for
    agent, obs = agent_for("reinflow", log_prob_over="executed")
    chain, log_prob, stochastic, step_lp = agent.sample(obs, torch.Generator().manual_seed(0), return_steps=True)
    adv = torch.tensor([3.0, -1.0, 0.5, 2.0, -2.0, 1.5])
    w = torch.ones(6)
    assert abs(ppo.standardise(adv, w).mean()) < 1e-6 and \
        torch.allclose(ppo.standardise(adv, w).std(unbiased=False), torch.ones(()), atol=1e-4)

    def step(mode, minibatch, advantages):
        moved = copy.deepcopy(agent)
        cfg = stage3.Stage3Config(minibatch_size=minibatch, update_epochs=1, ent_coef=0.0, adv_norm=mode)
        batch = {"obs": obs, "chains": chain, "log_probs": log_prob, "stochastic": stochastic,
                 "step_log_probs": step_lp, "values": torch.zeros(6), "advantages": advantages, "returns": adv}
        opt_a = torch.optim.SGD(moved.policy_parameters(), lr=0.1)
        opt_c = torch.optim.SGD(moved.value_parameters(), lr=0.0)
        ppo.ppo_update(moved, batch, opt_a, opt_c, cfg, generator=torch.Generator().manual_seed(1))
        return torch.cat([p.detach().flatten() for p in moved.policy_parameters()])

    assert torch.equal(step("minibatch", 6, adv), step("batch", 6, adv))
    assert not torch.allclose(step("minibatch", 3, adv), step("batch", 3, adv))
    assert torch.allclose(step("off", 3, ppo.standardise(adv, w)), step("batch", 3, adv))
    assert not torch.allclose(step("off", 3, adv), step("batch", 3, adv))
    with pytest.raises(ValueError, match="adv_norm must be one of"):
        stage3.Stage3Config(adv_norm="global")
