"""Seeing policies (flowlib.envs.visual, flowlib.policies.encoders): packed frames, DrQ's shift, farthest-point sampling, the
encoders' shapes and freezing, and on a real PickCube env on CPU: demos rendered into rgb / rgbd / pointcloud that
line up with the state demos and with the env's own observations, a stage-1 run and a two-iteration stage-3 run with
the encoder frozen."""
import dataclasses
import types

import numpy as np
import pytest
import torch
from test_reinflow import (
    fake_batch,  # the chain batch a PPO update reads
    tiny_policy,  # a state stage-1 policy of PickCube's dims
)

from flowlib.envs import visual, visual_demos
from flowlib.envs.data import Normalizer, generate_demos
from flowlib.envs.maniskill import EnvSpec, make_env
from flowlib.envs.smdp import ChunkRunner
from flowlib.infra.tracking import Tracker
from flowlib.methods import stage3
from flowlib.methods.residual_td3 import StepResidualTD3Agent, optimizers, replay_buffer, td3_update
from flowlib.policies import bc
from flowlib.policies.encoders import PointNetEncoder, SpatialSoftmaxCNN, VisualObsEncoder
from flowlib.rl import ppo
from flowlib.tools import bench

RGB = visual.ObsLayout("rgb", 5, (8, 8, 3))
CLOUD = visual.ObsLayout("pointcloud", 5, (16, 3))


def test_a_packed_frame_splits_into_state_and_view_and_a_wrong_width_is_named():
    frames = torch.randn(2, 3, RGB.dim)
    state, view = RGB.split(frames)
    assert state.shape == (2, 3, 5) and view.shape == (2, 3, 8, 8, 3)
    assert torch.equal(torch.cat([state, view.flatten(2)], -1), frames)
    with pytest.raises(ValueError, match=r"a packed rgb frame has 197 values \(5 state \+ \(8, 8, 3\) view\), got 42"):
        RGB.split(torch.randn(2, 42))
    assert visual.ObsLayout.from_dict(RGB.to_dict()) == RGB
    with pytest.raises(ValueError, match="obs_mode must be one of"):
        bc.ShortCutBCConfig(obs_mode="depth")
    with pytest.raises(ValueError, match="obs_mode 'rgb' reads the view through an obs_encoder: set obs_emb_dim > 0"):
        bc.ShortCutBCConfig(obs_mode="rgb")


def test_the_packed_normaliser_fits_the_state_and_maps_colour_to_plus_minus_one():
    state_norm = Normalizer.fit(np.random.default_rng(0).normal(3.0, 2.0, (100, 5)))
    norm = visual_demos.packed_normalizer(state_norm, RGB)
    frame = torch.cat([torch.full((5,), 3.0), torch.tensor([0.0, 127.5, 255.0]).repeat(64)])
    state, view = RGB.split(norm.normalize(frame))
    assert torch.allclose(state, state_norm.normalize(torch.full((5,), 3.0)))
    assert torch.allclose(view[0, 0], torch.tensor([-1.0, 0.0, 1.0]))
    depth = visual_demos.packed_normalizer(state_norm, visual.ObsLayout("rgbd", 5, (8, 8, 4)))
    assert torch.equal(depth.scale[5:].reshape(8, 8, 4)[..., 3], torch.ones(8, 8))  # metres stay metres


def test_random_shift_translates_each_sample_by_one_offset_for_all_its_frames():
    view = torch.arange(2 * 2 * 8 * 8 * 3, dtype=torch.float32).reshape(2, 2, 8, 8, 3)
    assert visual.random_shift(view, 0) is view
    shifted = visual.random_shift(view, 2, torch.Generator().manual_seed(0))
    assert shifted.shape == view.shape
    rows, cols = torch.arange(-2, 10).clamp(0, 7), torch.arange(-2, 10).clamp(0, 7)  # edge-replicated padding
    padded = view[:, :, rows][:, :, :, cols]  # [2, 2, 12, 12, 3]
    for b in range(2):
        offsets = [(dy, dx) for dy in range(5) for dx in range(5)
                   if torch.equal(shifted[b], padded[b, :, dy:dy + 8, dx:dx + 8])]
        assert len(offsets) == 1  # one crop of the padded window, the same for both frames
    windows = torch.cat([torch.zeros(2, 2, 5), view.flatten(2)], -1)  # packed: the state is left alone
    out = visual.augment_window(windows, visual.ObsLayout("rgb", 5, (8, 8, 3)), 2)
    assert torch.equal(out[..., :5], windows[..., :5]) and not torch.equal(out, windows)


def test_farthest_point_sampling_reaches_the_extremes_and_pads_a_small_cloud():
    xyz = torch.cat([torch.rand(200, 3) * 0.1, torch.tensor([[5.0, 0, 0], [-5.0, 0, 0]])])
    chosen = visual.farthest_point_sample(xyz, 3)
    assert {200, 201} <= set(chosen.tolist())  # from point 0, the two far points come next
    assert visual.farthest_point_sample(xyz[:2], 4).tolist() == [0, 1, 1, 1]


def test_encoders_map_frames_to_features_and_a_point_cloud_encoder_ignores_point_order():
    cnn = SpatialSoftmaxCNN(4, feature_dim=12, channels=8, keypoints=6)
    features, maps = cnn(torch.rand(3, 16, 16, 4), return_maps=True)
    assert features.shape == (3, 12) and maps.shape == (3, 6, 4, 4)  # two stride-2 convolutions
    assert torch.allclose(maps.sum((-1, -2)), torch.ones(3, 6))  # a softmax over pixels per keypoint
    net = PointNetEncoder(feature_dim=12)
    points = torch.randn(2, 16, 3)
    assert torch.allclose(net(points), net(points[:, torch.randperm(16)]), atol=1e-6)
    for layout in (RGB, CLOUD):
        encoder = VisualObsEncoder(layout, obs_horizon=2, obs_emb_dim=10, feature_dim=12)
        assert encoder(torch.randn(4, 2 * layout.dim)).shape == (4, 10)
        with pytest.raises(ValueError, match="make the env with the policy's obs_mode"):
            encoder(torch.randn(4, 2 * 42))


def tiny_visual_policy(layout: visual.ObsLayout):
    meta = {"env_id": "PickCube-v1", "control_mode": "pd_ee_delta_pos", "obs_dim": layout.dim, "action_dim": 4,
            "obs_horizon": 2, "pred_horizon": 16, "act_horizon": 8, "velocity_net": "unet", "down_dims": [8, 16],
            "mlp_dims": [16], "emb_dim": 8, "obs_emb_dim": 8, "ema_decay": 0.9, "shortcut_max_steps": 8,
            "bootstrap_fraction": 0.25, "obs_mode": layout.mode, "obs_layout": layout.to_dict(), "camera_size": 8,
            "num_points": 16}
    return bc.build_policy(meta, visual_demos.packed_normalizer(Normalizer(5), layout))


@pytest.mark.parametrize("layout", [RGB, CLOUD], ids=["rgb", "pointcloud"])
@pytest.mark.parametrize("freeze", [True, False], ids=["frozen", "trained"])
def test_a_frozen_visual_encoder_takes_no_gradient_and_keeps_its_weights_through_a_ppo_update(layout, freeze):
    policy = tiny_visual_policy(layout)
    cfg = stage3.Stage3Config(num_inference_steps=4, value_hidden_dims=[16], minibatch_size=5, update_epochs=2,
                              freeze_obs_encoder=freeze)
    agent = stage3.make_agent(policy, cfg)
    encoder = agent.actor.base.obs_encoder
    assert isinstance(encoder, VisualObsEncoder)
    assert agent.actor.noise_net.body[0].in_features == 32 + 8  # t's embedding + the encoder's 8, not the pixels
    before = [p.clone() for p in encoder.parameters()]
    obs = torch.rand(5, 2, layout.dim) * 100
    opt_a = torch.optim.Adam(agent.policy_parameters(), 1e-3)
    opt_c = torch.optim.Adam(agent.value_parameters(), 1e-3)
    ppo.ppo_update(agent, fake_batch(agent, obs), opt_a, opt_c, cfg)
    moved = [not torch.equal(a, b) for a, b in zip(before, encoder.parameters())]
    assert any(moved) is not freeze
    if freeze:
        assert all(p.grad is None or not p.grad.any() for p in encoder.parameters())


def test_a_residual_on_a_visual_policy_reads_and_replays_the_frozen_encoders_embedding_not_the_pixels():
    policy = tiny_visual_policy(RGB)
    agent = StepResidualTD3Agent(policy, 4, value_hidden_dims=(16,), residual_hidden=(16,))
    obs, base = torch.rand(5, 2, RGB.dim) * 255, torch.randn(5, 4)
    observed = agent.observe(obs)
    assert observed.shape == (5, 8) and agent.state_dim == 8 + 4
    torch.testing.assert_close(agent.state(obs, base), agent.state(observed, base))  # from frames or from the replay
    assert torch.equal(observed, agent.flow.net.obs_encoder(agent.norm_obs(obs).flatten(1)))
    assert replay_buffer(agent, 10).data["obs"].shape == (10, 8)  # 32 bytes a transition, not 2 x 197 floats
    state_agent = StepResidualTD3Agent(tiny_policy()[0], 4, value_hidden_dims=(16,), residual_hidden=(16,))
    window = torch.randn(3, 2, 42)
    assert state_agent.observe(window) is window  # a state policy's replay keeps the window, as before
    problem = stage3.visual_problem(stage3.Stage3Config(steer="latent", learner="sac"), policy.meta, "start.pt")
    assert "start.pt reads rgb observations; of the stage-3 methods only chain/ppo, residual_step/td3" in problem
    assert stage3.visual_problem(stage3.Stage3Config(), policy.meta, "start.pt") == ""  # chain ReinFlow
    # the shaped learning terms read the cube from the state vector: refused on a camera's observations
    env = types.SimpleNamespace(spec=EnvSpec("PickCube-v1", RGB.dim, 4, "pd_ee_delta_pos", 100, "rgb"))
    with pytest.raises(ValueError, match="reach_weight read the cube .* this env observes rgb: use reward 'dense'"):
        ChunkRunner(env, 2, 0.9, reward="dense", reach_weight=1.0)


def test_an_asymmetric_critic_learns_a_value_that_only_the_simulators_state_holds():
    """The reward is the first state dim, which the frames do not show: the critic that reads the state fits it, the
    one that reads the camera's embedding cannot; the actor still reads the embedding."""
    policy = tiny_visual_policy(RGB)
    cfg = stage3.Stage3Config(steer="residual_step", learner="td3", num_inference_steps=4, value_hidden_dims=[32, 32],
                              residual_hidden_dims=[16], asymmetric_critic=True, critic_lr=1e-3)
    with pytest.raises(ValueError, match="asymmetric_critic needs the width of the env's state observation"):
        stage3.make_agent(policy, cfg)
    with pytest.raises(ValueError, match="this start policy reads the state already"):
        stage3.make_agent(tiny_policy()[0], cfg, state_dim=42)
    g = torch.Generator().manual_seed(0)
    # one view and one base action for all: what differs between the transitions is only in the simulator's state
    frames, base = (torch.rand(1, 2, RGB.dim, generator=g) * 255).expand(64, -1, -1), torch.randn(1, 4).expand(64, -1)
    priv = torch.randn(64, 7, generator=g) * torch.tensor([0.1, 1, 1, 1, 1, 1, 1]) + 3.0
    losses = {}
    for asymmetric in (True, False):
        agent = stage3.make_agent(policy, dataclasses.replace(cfg, asymmetric_critic=asymmetric), state_dim=7)
        buffer = replay_buffer(agent, 100)
        observed = agent.observe(frames)
        row = dict(obs=observed, latent=torch.zeros(64, 4), reward=(priv[:, 0] - 3.0) / 0.1, bootstrap=torch.zeros(64),
                   next_obs=observed, base=base, next_base=base)
        if asymmetric:
            assert agent.q.nets[0][0].in_features == 7 + 4 + 4  # [state, a_b] and r: no embedding
            assert set(buffer.fields) >= {"priv", "next_priv"}
            with pytest.raises(RuntimeError, match="normaliser is not fitted"):
                agent.critic_state(agent.state(observed, base), priv, base)
            agent.fit_critic_normalizer(priv)
            assert torch.allclose(agent.critic_obs_mean, priv.mean(0))
            assert agent.critic_obs_std.min() >= 1e-2
            row.update(priv=priv, next_priv=priv)
        buffer.add(**row)
        actor_opt, critic_opt = optimizers(agent, cfg)
        stats = [td3_update(agent, buffer.sample(64, g), actor_opt, critic_opt, cfg, train_policy=False)
                 for _ in range(400)]
        losses[asymmetric] = stats[-1]["value_loss"]
    assert losses[True] < 0.1 * losses[False]  # the camera's view is one frame: the reward is not in it


def test_chain_ppos_asymmetric_value_reads_the_state_fits_what_only_it_holds_and_is_refused_where_it_cannot_run():
    """Chain PPO's V with asymmetric_critic: the first rollout's states fit its normaliser and value the buffer; on
    one camera frame it fits returns that only the state explains, which the embedding's V cannot."""
    from flowlib.methods.reinflow import value_states
    from flowlib.rl.buffers import RolloutBuffer
    policy = tiny_visual_policy(RGB)
    cfg = stage3.Stage3Config(num_inference_steps=4, value_hidden_dims=[32, 32], minibatch_size=64, update_epochs=1,
                              asymmetric_critic=True, critic_lr=1e-3)
    with pytest.raises(ValueError, match="asymmetric_critic needs the width of the env's state observation"):
        stage3.make_agent(policy, cfg)
    for bad, match in (({"critic_input": "velocity_features"}, "critic_input must be 'obs'"),
                       ({"branches": 2, "advantage": "branch"}, "use branches: 1"),
                       ({"steer": "latent"}, "does not read asymmetric_critic .AsymmetricConfig, read by steer/learner "
                                             "chain/ppo, residual_step/td3, residual_step/ppo")):
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(cfg, **bad)
    g = torch.Generator().manual_seed(0)
    frames = (torch.rand(1, 2, RGB.dim, generator=g) * 255).expand(64, -1, -1)
    states = torch.randn(64, 7, generator=g) * torch.tensor([0.1, 1, 1, 1, 1, 1, 1]) + 3.0
    returns = (states[:, 0] - 3.0) / 0.1
    losses = {}
    for asymmetric in (True, False):
        agent = stage3.make_agent(policy, dataclasses.replace(cfg, asymmetric_critic=asymmetric), state_dim=7)
        batch = fake_batch(agent, frames) | {"returns": returns}
        if asymmetric:
            assert agent.value_net[0].in_features == 7
            with pytest.raises(ValueError, match=r"reads the simulator's state \(7 dims; asymmetric_critic\), got None"):
                agent.value(frames)
            with pytest.raises(RuntimeError, match="normaliser is not fitted"):
                agent.value(frames, states)
            T, N = 4, 16  # the rollout's [T, N] layout; one env idles (weight 0) with an outlying state
            buf = RolloutBuffer(*(torch.zeros(T, N) for _ in range(12)), states=states.reshape(T, N, 7).clone(),
                                next_states=states.reshape(T, N, 7).flip(0))
            buf.weights = torch.ones(T, N)
            buf.weights[:, 0] = 0
            buf.states[:, 0] = 1e3
            value_states(agent, buf)
            live = states.reshape(T, N, 7)[:, 1:].reshape(-1, 7)
            assert torch.allclose(agent.critic_obs_mean, live.mean(0)) and bool(agent.critic_obs_fitted)
            assert torch.allclose(buf.next_values, agent.value(None, buf.next_states.flatten(0, 1)).reshape(T, N))
            batch["states"] = states
        opt_a = torch.optim.Adam(agent.policy_parameters(), 1e-3)
        opt_c = torch.optim.Adam(agent.value_parameters(), 1e-3)
        stats = [ppo.ppo_update(agent, batch, opt_a, opt_c, cfg, train_policy=False) for _ in range(300)]
        losses[asymmetric] = stats[-1]["value_loss"]
    assert losses[True] < 0.1 * losses[False]


def test_per_step_residual_ppos_asymmetric_value_reads_the_normalised_state_beside_the_base_action():
    policy = tiny_visual_policy(RGB)
    cfg = stage3.Stage3Config(steer="residual_step", learner="ppo", num_inference_steps=4, value_hidden_dims=[16],
                              residual_hidden_dims=[16], asymmetric_critic=True)
    agent = stage3.make_agent(policy, cfg, state_dim=7)
    assert agent.state_value[0].in_features == 7 + 4
    g = torch.Generator().manual_seed(0)
    T, N = 3, 4
    frames = torch.rand(T, N, 2, RGB.dim, generator=g) * 255
    observed = agent.observe(frames.flatten(0, 1)).reshape(T, N, -1)
    priv = torch.randn(T, N, 7, generator=g) * 5 + 2
    steps = dict(obs=observed, next_obs=observed, base=torch.randn(T, N, 4, generator=g),
                 next_base=torch.randn(T, N, 4, generator=g), latent=torch.zeros(T, N, 4), reward=torch.zeros(T, N),
                 bootstrap=torch.full((T, N), 0.9), end=torch.zeros(T, N, dtype=torch.bool), priv=priv,
                 next_priv=priv.flip(0))
    buf = agent.score_rollout(steps)
    assert bool(agent.critic_obs_fitted) and torch.allclose(agent.critic_obs_mean, priv.flatten(0, 1).mean(0))
    assert buf.states.shape == (T, N, 7 + 4)
    assert torch.allclose(buf.states[..., :7], (priv - agent.critic_obs_mean) / agent.critic_obs_std)
    view = agent.ppo_view()
    assert torch.allclose(buf.values, view.value(buf.obs.flatten(0, 1), buf.states.flatten(0, 1)).reshape(T, N))
    with pytest.raises(ValueError, match="this start policy reads the state already"):
        stage3.make_agent(tiny_policy()[0], cfg, state_dim=42)


# ----------------------------------------------------------------------------------------------- on a real env

@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """Two PickCube demos, rendered into each visual mode at 32 x 32 (under a temporary outputs root)."""
    root = tmp_path_factory.mktemp("outputs")
    mp = pytest.MonkeyPatch()
    mp.setenv("FLOWLIB_OUTPUTS", str(root))
    state = generate_demos("PickCube-v1", 2)
    yield state, {mode: visual_demos.replay_visual(state, mode, camera_size=32, num_points=64) for mode in visual.VISUAL_MODES}
    mp.undo()


@pytest.mark.sim
@pytest.mark.parametrize("mode, view, dtype", [("rgb", {"rgb": (32, 32, 3)}, np.uint8),
                                                ("rgbd", {"rgb": (32, 32, 3), "depth": (32, 32, 1)}, None),
                                                ("pointcloud", {"points": (64, 3)}, np.float16)])
def test_rendered_demos_have_the_declared_shapes_and_line_up_with_the_state_demos_and_the_env(rendered, mode, view,
                                                                                            dtype):
    import h5py

    state_path, paths = rendered
    data = visual_demos.VisualChunkDataset(paths[mode], 2, 16)
    streamed = visual_demos.VisualChunkDataset(paths[mode], 2, 16, in_memory=False)
    with h5py.File(paths[mode]) as f:
        g = f["traj_0"]
        T = len(g["actions"])
        for name, shape in view.items():
            assert g[name].shape == (T + 1, *shape)
        if dtype is not None:
            assert all(g[name].dtype == dtype for name in view)
        # the state part is the state demo's observation less the object and the contact flag (PickCube's layout)
        privileged = np.asarray(g["privileged"])
        assert np.allclose(np.asarray(g["state"]), np.c_[privileged[:, :18], privileged[:, 19:29]], atol=1e-6)
    # windows: frames, states and actions of the same steps; streamed from disk as read into memory
    (obs, actions), (obs_s, actions_s) = data.batch([0, 7]), streamed.batch([0, 7])
    assert torch.equal(obs, obs_s) and torch.equal(actions, actions_s)
    raw, chunk = data.window(0, 5)
    assert np.array_equal(chunk, data.states.window(0, 5)[1])
    assert np.allclose(raw[:, :data.layout.state_dim], data.episodes[0].obs[5:7])
    # the env, reset with the demo's seed, shows the demo's first frame
    with make_env("PickCube-v1", 1, obs_mode=mode, camera_size=32, num_points=64) as env:
        assert env.spec.obs_mode == mode and env.spec.obs_dim == data.layout.dim
        first = env.reset(seed=data.episodes[0].seed)[0].numpy()
    frame0 = data.window(0, 0)[0][-1]
    assert np.allclose(first[:data.layout.state_dim], frame0[:data.layout.state_dim], atol=1e-5)
    assert np.abs(first[data.layout.state_dim:] - frame0[data.layout.state_dim:]).mean() < 0.05
    if mode == "pointcloud":  # fewer points: the file's first ones, which are the env's own farthest-point sample
        fewer = visual_demos.VisualChunkDataset(paths[mode], 2, 16, num_points=16)
        assert fewer.layout.view_shape == (16, 3) and fewer.obs_dim == data.layout.state_dim + 48
        assert np.array_equal(fewer.window(0, 0)[0][-1], frame0[:data.layout.state_dim + 48])
        with make_env("PickCube-v1", 1, obs_mode=mode, camera_size=32, num_points=16) as env:
            first16 = env.reset(seed=data.episodes[0].seed)[0].numpy()
        assert np.allclose(first16, fewer.window(0, 0)[0][-1], atol=1e-2)  # float16 points in the file
        assert visual_demos.visual_demo_path(state_path, mode, 32, 16) == paths[mode]  # no new rendering
        with pytest.raises(ValueError, match="holds 64 points a frame, 128 asked: render the demos with num_points=128"):
            visual_demos.VisualChunkDataset(paths[mode], 2, 16, num_points=128)


@pytest.mark.sim
def test_a_visual_env_reports_the_simulators_state_as_a_state_env_observes_it_and_the_runner_keeps_it_per_episode():
    g = torch.Generator().manual_seed(0)
    with make_env("PickCube-v1", 2, obs_mode="rgb", camera_size=32, max_episode_steps=3) as env, \
            make_env("PickCube-v1", 2, max_episode_steps=3) as state_env:
        assert env.spec.state_dim == state_env.spec.obs_dim == state_env.spec.state_dim == 42
        env.reset(seed=7)
        state = state_env.reset(seed=7)
        assert env.privileged.shape == (2, 42) and torch.allclose(env.privileged, state, atol=1e-5)
        for _ in range(2):
            action = torch.rand(2, 4, generator=g) * 2 - 1
            env.step(action)
            state = state_env.step(action)[0]
            assert torch.allclose(env.privileged, state, atol=1e-4)  # the cube's pose included, which rgb obs lack
        runner = ChunkRunner(env, 2, 0.9, reward="dense", first_seed=100)
        assert torch.allclose(runner.privileged, state_env.reset(seed=[100, 101]), atol=1e-5)
        out = runner.step_chunk(torch.zeros(2, 4, 4))  # episodes of 3 steps: both end inside the chunk and restart
        assert out["end"].all() and out["next_privileged"].shape == (2, 42)
        state = state_env.reset(seed=[100, 101])
        for _ in range(3):
            state = state_env.step(torch.zeros(2, 4))[0]
        assert torch.allclose(out["next_privileged"], state, atol=1e-4)  # the episode's last state, for bootstrapping
        assert torch.allclose(runner.privileged, state_env.reset(seed=[102, 103]), atol=1e-5)  # the next episode's


@pytest.mark.sim
def test_a_visual_stage_1_run_trains_evaluates_and_reloads_then_stage_3_fine_tunes_it_with_the_encoder_frozen(
        rendered, tmp_path):
    data = visual_demos.VisualChunkDataset(rendered[1]["rgb"], 2, 16)
    cfg = bc.ShortCutBCConfig(env_id="PickCube-v1", velocity_net="unet", obs_mode="rgb", camera_size=32, obs_emb_dim=16,
                              down_dims=[8, 16], emb_dim=8,
                              train_steps=30, batch_size=16, warmup_steps=2, ckpt_every=30, log_every=5,
                              eval_every=30, num_eval_episodes=1, num_envs=1, max_episode_steps=10)
    tracker = Tracker(tmp_path / "bc")
    with make_env("PickCube-v1", 1, max_episode_steps=10, obs_mode="rgb", camera_size=32) as env:
        policy, best = bc.train(cfg, data, tmp_path / "bc", tracker, env=env)
        assert best["step"] == 30 and 0 <= best["success_once"] <= 1
    losses = [row["loss"] for row in tracker.rows if "loss" in row]
    assert losses[-1] < losses[0]
    loaded = bc.load_policy(tmp_path / "bc" / "best_model.pt")
    assert loaded.meta["obs_layout"] == data.layout.to_dict() and visual.policy_env_kwargs(loaded.meta) == {
        "obs_mode": "rgb", "camera_size": 32, "num_points": 64}  # the rendered data's
    with make_env("PickCube-v1", 1, max_episode_steps=10) as state_env:  # a state env is refused by name
        with pytest.raises(ValueError, match="reads obs_mode='rgb' observations, the env gives 'state'"):
            bc.check_compatible(loaded.meta, state_env.spec)
    s3 = stage3.Stage3Config(init_checkpoint=str(tmp_path / "bc" / "best_model.pt"), num_inference_steps=4,
                             rollout_steps=2, update_epochs=1, minibatch_size=2, total_env_steps=2 * (2 * 2 * 8),
                             critic_warmup_steps=0, max_episode_steps=10, eval_every=0, num_eval_episodes=1,
                             num_envs=2, value_hidden_dims=[16], freeze_obs_encoder=True)
    with make_env("PickCube-v1", 2, max_episode_steps=10, **visual.policy_env_kwargs(loaded.meta)) as env:
        agent, _ = stage3.build_agent(s3, stage3.init_checkpoint_path(s3), env.spec)
        encoder = {k: v.clone() for k, v in agent.actor.base.obs_encoder.state_dict().items()}
        out = stage3.train(s3, agent, env, tmp_path / "s3", Tracker(tmp_path / "s3"))
    assert out["iterations"] == 2
    for k, v in agent.actor.base.obs_encoder.state_dict().items():
        assert torch.equal(v.cpu(), encoder[k].cpu())
    assert dataclasses.asdict(s3)["freeze_obs_encoder"]
    # chain PPO with an asymmetric V: it reads the simulator's state, fitted on the first rollout, kept on reload
    asym = dataclasses.replace(s3, asymmetric_critic=True)
    with make_env("PickCube-v1", 2, max_episode_steps=10, **visual.policy_env_kwargs(loaded.meta)) as env:
        agent, how = stage3.build_agent(asym, stage3.init_checkpoint_path(asym), env.spec)
        out = stage3.train(asym, agent, env, tmp_path / "asym", Tracker(tmp_path / "asym"))
    assert out["iterations"] == 2 and agent.value_net[0].in_features == 42 and how == "fresh"
    reloaded = stage3.load_agent(tmp_path / "asym" / "last.pt")
    assert bool(reloaded.critic_obs_fitted) and torch.equal(reloaded.critic_obs_mean, agent.critic_obs_mean.cpu())
    # the target recipe with an asymmetric critic: the critics read the simulator's state, the replay keeps it
    td3 = stage3.Stage3Config(init_checkpoint=s3.init_checkpoint, steer="residual_step", learner="td3",
                              asymmetric_critic=True, num_inference_steps=4, rollout_steps=2, num_envs=2,
                              total_env_steps=2 * (2 * 2 * 8), critic_warmup_steps=0, replay_batch_size=8,
                              max_episode_steps=10, eval_every=0, num_eval_episodes=1, value_hidden_dims=[16],
                              residual_hidden_dims=[16], reward="dense")
    with make_env("PickCube-v1", 2, max_episode_steps=10, **visual.policy_env_kwargs(loaded.meta)) as env:
        agent, _ = stage3.build_agent(td3, stage3.init_checkpoint_path(td3), env.spec)
        out = stage3.train(td3, agent, env, tmp_path / "td3", Tracker(tmp_path / "td3"))
    assert out["iterations"] == 2 and agent.q.nets[0][0].in_features == 42 + 4 + 4
    reloaded = stage3.load_agent(tmp_path / "td3" / "last.pt")
    assert bool(reloaded.critic_obs_fitted) and torch.equal(reloaded.critic_obs_mean, agent.critic_obs_mean.cpu())
    assert reloaded.critic_obs_std.min() >= 1e-2
    # notebook 06's benchmark table makes its own envs: with the policy's camera
    rows = bench.overhead_table(agent, dataclasses.replace(s3, bench_num_envs=[1], bench_decisions=1),
                                **visual.policy_env_kwargs(loaded.meta))
    row = rows[0]
    assert row["num_envs"] == 1
    assert row["overhead_fraction"] == pytest.approx(row["policy_ms_per_env_step"] / row["raw_step_ms"])
    # the loop spends the policy's time and more: it cannot step faster than the policy alone would allow
    assert row["loop_env_steps_per_s"] <= 1e3 / row["policy_ms_per_env_step"]
