"""Stage 2: SMDP targets, expectile loss, AWR weights, weighted ShortCut loss, critics, checkpoints."""
import dataclasses

import numpy as np
import pytest
import torch

from flowlib.envs.data import ChunkDataset, Episode, load_demos, save_episodes
from flowlib.flows.models import ShortCut
from flowlib.flows.nets import ConditionalMLP
from flowlib.policies import awsc, bc
from flowlib.policies import critic as critics

OBS_DIM, ACT_DIM = 3, 2


def episode(rewards, terminated_last: bool, obs_dim=OBS_DIM):
    T = len(rewards)
    obs = np.arange((T + 1) * obs_dim, dtype=np.float32).reshape(T + 1, obs_dim)  # row c holds 3c, 3c+1, 3c+2
    term = np.zeros(T, dtype=bool)
    trunc = np.zeros(T, dtype=bool)
    (term if terminated_last else trunc)[-1] = True
    r = np.asarray(rewards, dtype=np.float32)
    return Episode(obs, np.ones((T, ACT_DIM), np.float32), r, term.copy(), term, trunc)


def test_smdp_targets_match_a_hand_computed_example():
    # obs_horizon 1, act_horizon 3, gamma 0.5.  Episode 0 terminates at its 5th step, episode 1 is truncated.
    eps = [episode([1, 2, 3, 4, 5], terminated_last=True), episode([1, 1, 1, 1], terminated_last=False)]
    tr = critics.chunk_transitions(ChunkDataset(eps, 1, 4), act_horizon=3, gamma=0.5, reward="dense")
    assert len(tr) == 9  # one per decision step
    # episode 0, c = 0: R = 1 + 0.5*2 + 0.25*3, tau 3, bootstraps from s_3
    assert tr.reward[0] == pytest.approx(2.75) and tr.tau[0] == 3 and tr.discount[0] == pytest.approx(0.125)
    assert tr.next_obs[0, 0].tolist() == [9, 10, 11]
    # c = 3: the episode terminates inside the chunk (tau = 2): no bootstrap
    assert tr.reward[3] == pytest.approx(4 + 0.5 * 5) and tr.tau[3] == 2 and tr.discount[3] == 0 and tr.terminal[3]
    # Monte-Carlo return from c = 0
    assert tr.mc_return[0] == pytest.approx(1 + 0.5 * 2 + 0.25 * 3 + 0.125 * 4 + 0.0625 * 5)
    # episode 1, c = 2: truncated inside the chunk (tau = 2) -> bootstraps from the final state
    i = 5 + 2
    assert tr.tau[i] == 2 and tr.reward[i] == pytest.approx(1.5) and not tr.terminal[i]
    assert tr.discount[i] == pytest.approx(0.25) and tr.next_obs[i, 0].tolist() == [12, 13, 14]


def test_sparse_reward_is_the_success_flag_and_truncate_at_success_ends_the_episode():
    ep = episode([0.1, 0.2, 0.3, 0.4], terminated_last=False)
    ep.success[:] = [False, True, True, False]
    cut = critics.truncate_at_success(ep)
    assert len(cut) == 2 and cut.obs.shape == (3, OBS_DIM)
    assert cut.terminated.tolist() == [False, True] and not cut.truncated.any()
    tr = critics.chunk_transitions(ChunkDataset([cut], 1, 4), act_horizon=4, gamma=0.9, reward="sparse")
    assert tr.reward.tolist() == pytest.approx([0.9, 1.0]) and tr.discount.tolist() == [0, 0]
    failure = episode([0.0] * 3, terminated_last=False)
    assert critics.truncate_at_success(failure) is failure


def test_uncut_windows_take_the_weight_of_their_cut_window_up_to_the_success_and_of_the_success_step_after_it():
    # obs_horizon 2: an episode of T steps has T windows, deciding at c = s + 1 = 0 .. T - 1
    hit = episode([0.0] * 6, terminated_last=False)
    hit.success[:] = [False, False, True, False, True, True]  # first success at step 2: the cut keeps 3 steps
    miss = episode([0.0] * 4, terminated_last=False)  # never succeeds: cut == uncut
    full = ChunkDataset([hit, miss], 2, 4)
    cut = ChunkDataset([critics.truncate_at_success(ep) for ep in [hit, miss]], 2, 4)
    idx = critics.cut_window_index(full, cut)
    assert len(idx) == len(full) == 10 and len(cut) == 7
    # hit: decisions 0, 1, 2 are the cut windows 0, 1, 2; decisions 3, 4, 5 (after the success) map to 2
    assert idx.tolist() == [0, 1, 2, 2, 2, 2, 3, 4, 5, 6]
    # the mapped window decides on the same observations up to the cut, at the success step after it
    for i, (e, s) in enumerate(full.index):
        ce, cs = cut.index[idx[i]]
        assert ce == e and cs == min(s, len(cut.episodes[e]) - 2)
    assert torch.equal(torch.as_tensor(np.stack([cut.window(*cut.index[j])[0] for j in idx[:3]])),
                       torch.as_tensor(np.stack([full.window(*full.index[j])[0] for j in range(3)])))
    with pytest.raises(ValueError, match="uncut dataset first"):
        critics.cut_window_index(cut, full)
    with pytest.raises(ValueError, match="same episodes"):
        critics.cut_window_index(full, ChunkDataset([hit], 2, 4))


def test_nan_rewards_are_rejected():
    ep = episode([1.0, float("nan")], terminated_last=True)
    with pytest.raises(ValueError, match="NaN"):
        critics.chunk_transitions(ChunkDataset([ep], 1, 2), 2, 0.9, "dense")


def test_expectile_loss_is_half_mse_at_one_half_and_asymmetric_otherwise():
    u = torch.randn(1000)
    assert critics.expectile_loss(u, 0.5) == pytest.approx(0.5 * u.pow(2).mean().item(), rel=1e-6)
    pos = torch.tensor([1.0])
    assert critics.expectile_loss(pos, 0.9) == pytest.approx(0.9)
    assert critics.expectile_loss(-pos, 0.9) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="expectile"):
        critics.expectile_loss(u, 1.0)


def test_weights_are_clipped_and_ess_measures_their_spread():
    adv = torch.tensor([-1.0, 0.0, 1.0, 10.0])
    w = critics.advantage_weights(adv, beta=1.0, max_weight=5.0)
    assert w.tolist() == pytest.approx([np.exp(-1), 1.0, np.e, 5.0])
    soft = critics.advantage_weights(adv, beta=1.0, kind="softmax")
    assert soft.sum() == pytest.approx(4.0)
    assert critics.effective_sample_size(torch.ones(10)) == pytest.approx(1.0)
    assert critics.effective_sample_size(torch.tensor([1.0] + [0.0] * 9)) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="NaN"):
        critics.advantage_weights(torch.tensor([float("nan")]), 1.0)


def test_weighted_shortcut_loss_with_equal_weights_is_the_unweighted_loss():
    flow = ShortCut(ConditionalMLP(4, obs_dim=3, hidden=16, depth=2, emb_dim=8), max_steps=8)
    x1, obs = torch.randn(32, 4), torch.randn(32, 3)
    torch.manual_seed(0)
    plain, _ = flow.loss(x1, obs)
    torch.manual_seed(0)
    weighted, _ = flow.loss(x1, obs, weight=torch.ones(32))
    torch.manual_seed(0)
    doubled, _ = flow.loss(x1, obs, weight=torch.full((32,), 2.0))
    assert weighted.item() == pytest.approx(plain.item(), rel=1e-6)
    assert doubled.item() == pytest.approx(2 * plain.item(), rel=1e-6)


def two_outcome_data(n=40, T=12, seed=0, told_by="obs"):
    """Half the episodes succeed (sparse reward at the end); ``told_by`` says whether the observations
    or only the actions tell the two kinds apart."""
    rng = np.random.default_rng(seed)
    eps = []
    for i in range(n):
        good = i % 2 == 0
        obs = rng.normal(size=(T + 1, OBS_DIM)).astype(np.float32) * 0.1
        if told_by == "obs":
            obs[:, 0] += 1.0 if good else -1.0
        actions = (rng.normal(size=(T, ACT_DIM)) * 0.1 + (0.5 if good else -0.5)).astype(np.float32)
        success = np.zeros(T, dtype=bool)
        success[-1] = good
        trunc = np.zeros(T, dtype=bool)
        trunc[-1] = not good
        eps.append(Episode(obs, actions, success.astype(np.float32), success, success.copy(), trunc))
    return eps


def fit_critic(kind, eps, steps=600):
    dataset = ChunkDataset(eps, 2, 8)
    data = critics.chunk_transitions(dataset, 4, gamma=0.9, reward="sparse")
    meta = {"obs_dim": OBS_DIM, "action_dim": ACT_DIM, "obs_horizon": 2, "act_horizon": 4}
    torch.manual_seed(0)
    critic = critics.build_critic(kind, meta, dataset.obs_normalizer, dataset.action_normalizer, [64, 64])
    rows = critics.train_critic(critic, data, steps=steps, batch_size=128, lr=1e-3)
    return critic, data, rows


@pytest.mark.parametrize("kind", ["iql", "mc"])
def test_critic_values_track_returns_when_states_tell_the_outcome(kind):
    critic, data, rows = fit_critic(kind, two_outcome_data(told_by="obs"))
    regression = "q_loss" if kind == "iql" else "value_loss"  # IQL's expectile loss starts at 0 (Q = V = 0)
    assert rows[-1][regression] < 0.5 * rows[0][regression]
    v = awsc.values(critic, data.obs).numpy()
    assert np.corrcoef(v, data.mc_return.numpy())[0, 1] > 0.8


@pytest.mark.parametrize("kind", ["iql", "mc"])
def test_advantages_rank_the_actions_that_lead_to_success_higher(kind):
    eps = two_outcome_data(told_by="actions")  # same states; only the chunk decides
    critic, data, _ = fit_critic(kind, eps)
    adv = awsc.advantages(critic, data)
    good = torch.as_tensor([bool(eps[e].success.any()) for e in data.episode.tolist()])
    assert adv[good].mean() > adv[~good].mean() + 0.1


def test_critic_rejects_wrong_window_shapes():
    meta = {"obs_dim": OBS_DIM, "action_dim": ACT_DIM, "obs_horizon": 2, "act_horizon": 4}
    dataset = ChunkDataset(two_outcome_data(4), 2, 8)
    critic = critics.build_critic("iql", meta, dataset.obs_normalizer, dataset.action_normalizer, [8])
    with pytest.raises(ValueError, match=r"obs must be \[B, 2, 3\]"):
        critic.value(torch.zeros(5, 1, OBS_DIM))
    with pytest.raises(ValueError, match=r"actions must be \[B, 4, 2\]"):
        critic.advantage(torch.zeros(5, 2, OBS_DIM), torch.zeros(5, 8, ACT_DIM))
    with pytest.raises(ValueError, match="critic must be one of"):
        critics.build_critic("td3", meta, dataset.obs_normalizer, dataset.action_normalizer, [8])


def test_episodes_round_trip_through_maniskill_trajectory_files(tmp_path):
    eps = [dataclasses.replace(ep, seed=1_000_000 + i) for i, ep in enumerate(two_outcome_data(3))]
    path = save_episodes(tmp_path / "rollouts.h5", eps, "PickCube-v1", "pd_ee_delta_pos")
    back = load_demos(path)
    assert len(back) == 3 and [ep.seed for ep in back] == [1_000_000, 1_000_001, 1_000_002]
    for a, b in zip(eps, back):
        for key in ("obs", "actions", "rewards", "success", "terminated", "truncated"):
            assert np.array_equal(getattr(a, key), getattr(b, key))
    with pytest.raises(ValueError, match="control_mode"):
        load_demos(path, control_mode="pd_joint_delta_pos")


def test_aw_checkpoint_holds_policy_and_critic_for_stage_3(tmp_path):
    eps = two_outcome_data(6)
    dataset = ChunkDataset(eps, 2, 8)
    cfg = bc.ShortCutBCConfig(env_id="PickCube-v1", velocity_net="unet", down_dims=[8, 16], emb_dim=8, pred_horizon=8, act_horizon=4, train_steps=3,
                              batch_size=8, warmup_steps=1, ckpt_every=3, log_every=1)
    stage1, _ = bc.train(cfg, dataset, tmp_path / "s1")
    critic = critics.build_critic("iql", stage1.meta, dataset.obs_normalizer, dataset.action_normalizer, [8])
    weights = torch.rand(len(dataset))
    stage2, _ = bc.train(cfg, dataset, tmp_path / "s2", policy=bc.load_policy(tmp_path / "s1" / "last.pt"),
                         weights=weights, extra={"critic": critics.critic_state(critic)},
                         checkpoint_format=bc.AW_CHECKPOINT_FORMAT)
    policy, loaded_critic = awsc.load_from_aw_shortcut_flow(tmp_path / "s2" / "best_model.pt")
    obs = torch.randn(4, 2, OBS_DIM)
    gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    assert torch.allclose(policy.act(obs, 2, gen()), stage2.cpu().act(obs, 2, gen()))  # trained on the GPU if any
    assert torch.allclose(loaded_critic.value(obs), critic.value(obs))
    assert awsc.load_from_aw_shortcut_flow(tmp_path / "s1" / "last.pt")[1] is None  # stage 1: no critic
    with pytest.raises(ValueError, match="weights must be"):
        bc.train(cfg, dataset, tmp_path / "s3", weights=torch.ones(3))
    with pytest.raises(ValueError, match="finite"):
        bc.train(cfg, dataset, tmp_path / "s4", weights=torch.full((len(dataset),), float("nan")))


def test_stage1_checkpoint_of_another_env_or_dims_is_rejected(tmp_path):
    meta = {"env_id": "PickCube-v1", "obs_dim": OBS_DIM, "action_dim": ACT_DIM}
    eps = two_outcome_data(2)
    awsc.check_data_fits(meta, eps, "PickCube-v1")
    with pytest.raises(ValueError, match="trained on PickCube-v1, this run is for StackCube-v1"):
        awsc.check_data_fits(meta, eps, "StackCube-v1")
    with pytest.raises(ValueError, match="obs_dim=5"):
        awsc.check_data_fits(meta, [episode([0.0], True, obs_dim=5)], "PickCube-v1")
    with pytest.raises(FileNotFoundError, match="run notebook 01 first"):
        awsc.stage1_checkpoint_path(awsc.AWShortCutConfig(stage1_checkpoint=str(tmp_path / "nope.pt")))


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="critic must be"):
        awsc.AWShortCutConfig(critic="sac")
    with pytest.raises(ValueError, match="expectile"):
        awsc.AWShortCutConfig(expectile=1.5)


def test_holdout_takes_a_share_of_every_source():
    sources = ["demo"] * 8 + ["rollout"] * 4
    mask = awsc.holdout_mask(sources, 0.25, seed=0)
    assert mask[:8].sum() == 2 and mask[8:].sum() == 1


def test_a_mask_as_weights_makes_the_weighted_mean_the_kept_samples_mean():
    """RFC offline (notebook 02) passes ``mask_weights`` to the same weighted loss as AW-ShortCut: for any
    per-sample loss, ``mean(w l)`` over all samples is the plain mean over the kept ones."""
    mask = torch.tensor([True, False, True, True, False, False, False, True])
    w = critics.mask_weights(mask)
    assert w.tolist() == [2.0, 0.0, 2.0, 2.0, 0.0, 0.0, 0.0, 2.0] and w.mean().item() == 1.0
    per_sample = torch.randn(8, generator=torch.Generator().manual_seed(0)).exp()
    assert (w * per_sample).mean().item() == pytest.approx(per_sample[mask].mean().item(), rel=1e-6)
    with pytest.raises(ValueError, match="keeps no sample"):
        critics.mask_weights(torch.zeros(8, dtype=torch.bool))


def test_config_rejects_an_unknown_rfc_mask():
    with pytest.raises(ValueError, match="rfc_masks must be a list of"):
        awsc.AWShortCutConfig(rfc_masks=["success_only", "top_half"])
    with pytest.raises(ValueError, match="rfc_topk"):
        awsc.AWShortCutConfig(rfc_topk=0.0)


@pytest.mark.parametrize("start_net", ["ema", "raw"])
def test_stage2_goes_on_from_the_weights_start_net_names(tmp_path, start_net):
    """Stage 1 scores (and saves as best) its EMA; ``start_net="ema"`` fine-tunes that policy, ``"raw"`` the live net
    behind it.  At a vanishing lr one step leaves the net where it started, so it must equal the chosen weights."""
    dataset = ChunkDataset(two_outcome_data(6), 2, 8)
    cfg1 = bc.ShortCutBCConfig(env_id="PickCube-v1", velocity_net="unet", down_dims=[8, 16], emb_dim=8, pred_horizon=8, act_horizon=4, train_steps=5,
                               batch_size=8, warmup_steps=1, ckpt_every=5, log_every=1)
    bc.train(cfg1, dataset, tmp_path / "s1")
    stage1 = bc.load_policy(tmp_path / "s1" / "last.pt")
    ema, raw = stage1.flow.ema.module.state_dict(), stage1.flow.net.state_dict()
    assert any(not torch.allclose(ema[k], raw[k]) for k in raw)  # 5 steps at decay 0.995: the EMA lags the net
    cfg2 = awsc.AWShortCutConfig(start_net=start_net, train_steps=1, batch_size=8, lr=1e-12, warmup_steps=0,
                                 ckpt_every=1, log_every=1, num_eval_episodes=1, resume=False)
    policies, _ = awsc.train_weighted(cfg2, dataset, tmp_path / "s2", None, tmp_path / "s1" / "last.pt",
                                      torch.ones(len(dataset)), extra={})
    trained = policies[0].cpu().flow.net.state_dict()
    want = ema if start_net == "ema" else raw
    assert all(torch.allclose(trained[k], want[k], atol=1e-6) for k in want)
    with pytest.raises(ValueError, match="start_net must be 'ema' or 'raw'"):
        awsc.AWShortCutConfig(start_net="best")
