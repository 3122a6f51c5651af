"""RFC's masks select what they claim on hand-made batches (ties included), success is read from a sparse reward's
episodes, the ratio logged is the kept share, and the registry takes chain/rfc with its own checks; RFC beside PPO
(``rfc_lambda``) adds exactly its masked loss, on the chain and on the latent steer."""
import copy

import pytest
import torch

from flowlib.methods import stage3
from flowlib.methods.rfc import episode_success, rfc_mask
from flowlib.rl import ppo


def test_each_mask_keeps_what_it_names_among_live_rows():
    adv = torch.tensor([0.5, -1.0, 2.0, 2.0, 0.0, 3.0, -0.2, 1.0])
    success = torch.tensor([1, 0, 1, 0, 0, 1, 1, 0], dtype=torch.bool)
    weights = torch.tensor([1.0, 1, 1, 1, 1, 0, 1, 1])  # row 5 is an idle env: never kept
    assert rfc_mask("success_only", adv, success, weights).tolist() == [1, 0, 1, 0, 0, 0, 1, 0]
    assert rfc_mask("advantage_positive", adv, success, weights).tolist() == [1, 0, 1, 1, 0, 0, 0, 1]
    # 7 live rows, top 2/7: the two 2.0s; top 1/7 = one row, and the row tied with it is kept too
    assert rfc_mask("advantage_topk", adv, success, weights, topk=2 / 7).tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    assert rfc_mask("advantage_topk", adv, success, weights, topk=0.1).tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    assert rfc_mask("advantage_topk", adv, success, weights, topk=0.5).tolist() == [1, 0, 1, 1, 0, 0, 0, 1]
    with pytest.raises(ValueError, match="rfc_mask must be one of"):
        rfc_mask("best", adv, success, weights)


def test_episode_success_follows_each_episode_to_its_end_within_the_rollout():
    # one env, 6 decisions: an episode that succeeds at t=2, one truncated at t=4 (no reward), one still running
    rewards = torch.tensor([[0.0], [0.0], [1.0], [0.0], [0.0], [0.0]])
    terminal = torch.tensor([[0], [0], [1], [0], [0], [0]], dtype=torch.bool)
    ends = torch.tensor([[0], [0], [1], [0], [1], [0]], dtype=torch.bool)
    assert episode_success(rewards, terminal, ends)[:, 0].tolist() == [True, True, True, False, False, False]


def test_the_registry_takes_chain_rfc_and_refuses_success_without_a_sparse_reward():
    cfg = stage3.Stage3Config(learner="rfc", rfc_mask="success_only", reward="sparse")
    assert stage3.method(cfg).summary.startswith("RFC")
    with pytest.raises(ValueError, match="set reward: sparse"):
        stage3.Stage3Config(learner="rfc", rfc_mask="success_only", reward="dense")
    with pytest.raises(ValueError, match="advantage must be one of"):
        stage3.Stage3Config(learner="rfc", advantage="grpo")
    with pytest.raises(ValueError, match="no PPO loss for bc_coeff"):
        stage3.Stage3Config(learner="rfc", bc_coeff=1.0)
    with pytest.raises(ValueError, match="rfc_lambda is 0"):  # chain PPO reads the mask only beside rfc_lambda
        stage3.Stage3Config(rfc_mask="advantage_topk")
    with pytest.raises(ValueError, match="does not read rfc_mask"):
        stage3.Stage3Config(steer="latent", learner="sac", rfc_mask="advantage_topk")
    with pytest.raises(ValueError, match="does not read rfc_lambda"):
        stage3.Stage3Config(learner="rfc", rfc_lambda=0.05)
    with pytest.raises(ValueError, match="use branches: 1 beside rfc_lambda"):
        stage3.Stage3Config(rfc_lambda=0.05, advantage="branch", branches=2)


def _rfc_batch(agent, obs, seed=0):
    """One chain decision per window, with hand-made advantages: rows 0, 2 and 5 positive, so the
    ``advantage_positive`` mask keeps exactly those."""
    chain, log_prob, stochastic, step_lp = agent.sample(obs, torch.Generator().manual_seed(seed), return_steps=True)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, -2.0, 2.0])
    return {"obs": obs, "chains": chain, "log_probs": log_prob, "stochastic": stochastic, "step_log_probs": step_lp,
            "values": torch.zeros(6), "advantages": adv, "returns": adv, "weights": torch.ones(6),
            "rfc_mask": adv > 0}


def _sgd_step(agent, batch, lam, regularise=True):
    """One plain SGD step (lr 1, no clip that binds) of ``ppo_update`` on the whole batch; the velocity net's change."""
    from flowlib.methods.rfc import RFCRegulariser
    moved = copy.deepcopy(agent)
    cfg = stage3.Stage3Config(minibatch_size=6, update_epochs=1, ent_coef=0.0, adv_norm="off", max_grad_norm=1e9,
                              actor_optimizer="sgd", rfc_lambda=lam or 1.0)
    before = [p.detach().clone() for p in moved.actor.base.parameters()]
    regs = [RFCRegulariser(moved, cfg)] if regularise else []
    for r in regs:
        r.coeff = lam
    opt_a = torch.optim.SGD(moved.policy_parameters(), lr=1.0)
    opt_c = torch.optim.SGD(moved.value_parameters(), lr=0.0)
    torch.manual_seed(7)  # the reflow loss's x_0 and times
    ppo.ppo_update(moved, batch, opt_a, opt_c, cfg, generator=torch.Generator().manual_seed(1), regularisers=regs)
    return [a.detach() - b for a, b in zip(moved.actor.base.parameters(), before)]


def test_rfc_beside_ppo_adds_lambda_times_the_masked_shortcut_loss_and_lambda_0_is_ppo_bit_for_bit():
    """``L = L_PPO + lambda * mean over the kept rows of the ShortCut loss``: under plain SGD the velocity net's step
    with lambda is PPO's step minus lambda times the gradient of that masked loss, computed here by hand from the
    kept rows alone; with lambda = 0 the step is PPO's, bit for bit."""
    from test_flow_sde import agent_for

    from flowlib.methods.rfc import RFCRegulariser
    agent, obs = agent_for("reinflow", log_prob_over="executed")
    batch = _rfc_batch(agent, obs)
    ppo_step = _sgd_step(agent, batch, 0.0, regularise=False)
    assert all(torch.equal(a, b) for a, b in zip(_sgd_step(agent, batch, 0.0), ppo_step))
    lam = 0.3
    with_rfc = _sgd_step(agent, batch, lam)
    # by hand: the ShortCut loss of the kept rows' executed chunks, the same draws (seed 7)
    ref = copy.deepcopy(agent)
    reg = RFCRegulariser(ref, stage3.Stage3Config(rfc_lambda=lam))
    perm = torch.randperm(6, generator=torch.Generator().manual_seed(1))  # the minibatch's order in ppo_update
    kept = perm[batch["rfc_mask"][perm]]                                   # rows 0, 2 and 5, in that order
    assert sorted(kept.tolist()) == [0, 2, 5]
    torch.manual_seed(7)
    loss, _ = reg.flow.loss(batch["chains"][kept][:, -1], obs=ref._norm_obs(obs[kept]))
    grads = torch.autograd.grad(loss, list(ref.actor.base.parameters()))
    for step, base, g in zip(with_rfc, ppo_step, grads):
        torch.testing.assert_close(step, base - lam * g, atol=1e-5, rtol=1e-4)
    assert any(g.abs().max() > 1e-4 for g in grads)  # the term is not zero here


def test_rfc_beside_ppo_on_a_steer_unfreezes_the_flow_and_both_move():
    """DSRL + RFC: with ``rfc_lambda`` the latent steer's policy parameters are its x_0 head and the flow's net, and
    one PPO update on a batch whose mask keeps rows moves both (the head by the ratio, the flow by the reflow)."""
    from test_latent import latent_agent
    agent, obs, _ = latent_agent()
    cfg = stage3.Stage3Config(steer="latent", minibatch_size=5, update_epochs=1, rfc_lambda=0.05, actor_lr=1e-2)
    learner = stage3.make_learner(agent, cfg)
    assert len(learner.regularisers) == 1 and agent.train_flow
    assert len(agent.policy_parameters()) == len(list(agent.head.parameters())) + len(list(agent.flow.net.parameters()))
    decision, log_prob, stochastic, step_lp = agent.sample(obs, torch.Generator().manual_seed(0), return_steps=True)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0])
    batch = {"obs": obs, "chains": decision, "log_probs": log_prob, "stochastic": stochastic, "step_log_probs": step_lp,
             "values": torch.zeros(5), "advantages": adv, "returns": adv, "rfc_mask": adv > 0}
    head = [p.detach().clone() for p in agent.head.parameters()]
    flow = [p.detach().clone() for p in agent.flow.net.parameters()]
    learner.build_optimizers()
    stats = ppo.ppo_update(agent, batch, learner.actor_opt, learner.critic_opt, cfg,
                           generator=torch.Generator().manual_seed(1), regularisers=learner.regularisers)
    assert stats["rfc_loss"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(head, agent.head.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(flow, agent.flow.net.parameters()))
