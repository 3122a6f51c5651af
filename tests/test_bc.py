"""Stage 1: U-Net shapes, checkpoints (round trip, resume after a kill, bad input), and a real
PickCube env on CPU driven by a policy."""
import dataclasses

import numpy as np
import pytest
import torch

from flowlib.envs.data import ChunkDataset, Episode
from flowlib.envs.maniskill import EnvSpec, check_env_id, make_env
from flowlib.envs.tasks import PICKCUBE_GRASPED, PICKCUBE_OBJ_TO_GOAL, PICKCUBE_TCP_TO_OBJ
from flowlib.flows.unet import ShortCutVelocityUNet1D
from flowlib.policies import bc

OBS_DIM, ACT_DIM = 42, 4  # PickCube-v1, state obs, pd_ee_delta_pos


def random_episodes(n=3, T=30, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        success = np.zeros(T, dtype=bool)
        out.append(Episode(rng.normal(size=(T + 1, OBS_DIM)).astype(np.float32),
                           rng.uniform(-1, 1, size=(T, ACT_DIM)).astype(np.float32),
                           np.zeros(T, np.float32), success, success.copy(), success.copy()))
    return out


def tiny_cfg(**kw):
    base = dict(env_id="PickCube-v1", velocity_net="unet", max_episode_steps=100, eval_every=0, down_dims=[8, 16], emb_dim=8, train_steps=20, batch_size=16, warmup_steps=2, ckpt_every=10,
                log_every=1, num_eval_episodes=1, num_envs=1)
    return bc.ShortCutBCConfig(**{**base, **kw})


@pytest.mark.parametrize("down_dims, H", [((8, 16), 16), ((8, 16, 32), 16), ((8, 16, 32), 8)])
def test_unet_maps_chunks_to_chunks(down_dims, H):
    net = ShortCutVelocityUNet1D(ACT_DIM, OBS_DIM, obs_horizon=2, pred_horizon=H, down_dims=down_dims, emb_dim=8)
    x, t, obs = torch.randn(5, H, ACT_DIM), torch.rand(5), torch.randn(5, 2, OBS_DIM)
    assert net(x, t, t, obs).shape == (5, H, ACT_DIM)


def test_unet_rejects_wrong_shapes_with_the_expected_ones():
    net = ShortCutVelocityUNet1D(ACT_DIM, OBS_DIM, 2, 16, down_dims=(8, 16), emb_dim=8)
    t = torch.rand(2)
    with pytest.raises(ValueError, match=r"x must be \[B, 16, 4\]"):
        net(torch.randn(2, 16, 7), t, t, torch.randn(2, 2, OBS_DIM))
    with pytest.raises(ValueError, match=r"obs must be \[B, 2, 42\]"):
        net(torch.randn(2, 16, 4), t, t, torch.randn(2, 3, OBS_DIM))
    with pytest.raises(ValueError, match="divisible"):
        ShortCutVelocityUNet1D(ACT_DIM, OBS_DIM, 2, 10, down_dims=(8, 16, 32))


def test_an_obs_encoder_is_the_one_module_that_reads_the_observation():
    """With ``obs_emb_dim`` the window reaches FiLM only through ``obs_encoder`` ``[B, To * O] -> [B, obs_emb_dim]``:
    two windows give different velocities, and the same once the encoder maps both to one code."""

    class Constant(torch.nn.Module):
        def forward(self, flat):  # [B, To * O] -> [B, 12]
            return torch.ones(flat.shape[0], 12)

    torch.manual_seed(0)
    net = ShortCutVelocityUNet1D(ACT_DIM, OBS_DIM, 2, 16, down_dims=(8, 16), emb_dim=8, obs_emb_dim=12)
    assert ShortCutVelocityUNet1D(ACT_DIM, OBS_DIM, 2, 16, down_dims=(8, 16), emb_dim=8).obs_encoder is None
    x, t, obs, other = torch.randn(3, 16, ACT_DIM), torch.rand(3), torch.randn(3, 2, OBS_DIM), torch.randn(3, 2, OBS_DIM)
    assert net.obs_encoder(obs.flatten(1)).shape == (3, 12)
    with torch.no_grad():
        assert not torch.allclose(net(x, t, t, obs), net(x, t, t, other))
        net.obs_encoder = Constant()
        torch.testing.assert_close(net(x, t, t, obs), net(x, t, t, other))
    with pytest.raises(ValueError, match=r"obs must be \[B, 2, 42\]"):
        net(x, t, t, torch.randn(3, 3, OBS_DIM))


def test_a_checkpoint_from_before_obs_emb_dim_loads_and_resumes_as_the_same_policy(tmp_path, capsys):
    """Checkpoints written before ``obs_emb_dim`` existed have no such key; they mean 0 (no encoder), so they load,
    and ``bc.train`` resumes them rather than calling them a run of other settings."""
    dataset = ChunkDataset(random_episodes(), 2, 16)
    cfg = tiny_cfg(train_steps=4, ckpt_every=2)
    bc.train(cfg, dataset, tmp_path)
    ckpt = torch.load(tmp_path / "last.pt", weights_only=False)
    assert ckpt["meta"]["obs_emb_dim"] == 0
    del ckpt["meta"]["obs_emb_dim"]
    torch.save(ckpt, tmp_path / "last.pt")
    assert bc.read_checkpoint(tmp_path / "last.pt")["meta"] == bc.policy_meta(cfg, dataset, "pd_ee_delta_pos")
    old = bc.load_policy(tmp_path / "last.pt")
    assert old.flow.net.obs_encoder is None
    capsys.readouterr()
    bc.train(tiny_cfg(train_steps=6, ckpt_every=2), dataset, tmp_path)
    assert "at step 4" in capsys.readouterr().out  # resumed, not refused or restarted
    assert bc.read_checkpoint(tmp_path / "last.pt")["step"] == 6


def test_config_rejects_inconsistent_horizons_and_steps():
    with pytest.raises(ValueError, match="act_horizon"):
        bc.ShortCutBCConfig(act_horizon=16)
    with pytest.raises(ValueError, match="divide shortcut_max_steps"):
        bc.ShortCutBCConfig(eval_inference_steps=[3])
    with pytest.raises(ValueError, match="lr_schedule must be one of"):
        bc.ShortCutBCConfig(lr_schedule="step")
    with pytest.raises(ValueError, match="action_norm must be one of"):
        bc.ShortCutBCConfig(action_norm="none")


@pytest.mark.parametrize("schedule, late", [("cosine", 0.0), ("constant", 1.0)])
def test_learning_rate_warms_up_then_decays_or_holds(schedule, late):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = bc.cosine_with_warmup(opt, warmup_steps=4, total_steps=20, schedule=schedule)
    lrs = []
    for _ in range(20):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0] and lrs[4] == 1.0
    assert sched.get_last_lr()[0] == pytest.approx(late)


def test_the_policy_and_the_dataset_own_their_normalisers_so_moving_the_policy_moves_neither_dataset():
    """Training moves the policy to the GPU.  The dataset it was fitted on keeps its normalisers where they were (a
    critic built from them after stage 1 crashed on an H200 with CUDA statistics and CPU weights), and so does a
    stage-2 dataset built from the policy's.  ``double()`` stands in for ``to("cuda")``: any move of the buffers."""
    eps = random_episodes()
    dataset = ChunkDataset(eps, 2, 16)
    cfg = tiny_cfg()
    policy = bc.build_policy(bc.policy_meta(cfg, dataset, "pd_ee_delta_pos"), dataset.obs_normalizer,
                             dataset.action_normalizer)
    stage2 = ChunkDataset(eps, 2, 16, policy.obs_normalizer, policy.action_normalizer)
    before = stage2.tensors()
    policy.double()
    assert policy.obs_normalizer.shift.dtype == torch.float64
    for data in (dataset, stage2):
        assert data.obs_normalizer.shift.dtype == data.action_normalizer.scale.dtype == torch.float32
    torch.testing.assert_close(stage2.tensors(), before)
    torch.testing.assert_close(stage2.obs_normalizer.shift, dataset.obs_normalizer.shift)  # copies, same statistics


def test_training_normalises_the_data_as_the_policy_does_not_as_the_dataset_does(tmp_path, monkeypatch):
    """A resumed run (its checkpoint's statistics) or stage 2 (stage 1's) may hold normalisers other than the ones
    fitted on the dataset at hand: the flow must see the data as the policy will see observations when it acts."""
    eps = random_episodes()
    dataset = ChunkDataset(eps, 2, 16)
    cfg = tiny_cfg(train_steps=2)
    policy = bc.build_policy(bc.policy_meta(cfg, dataset, "pd_ee_delta_pos"), dataset.obs_normalizer,
                             dataset.action_normalizer)
    policy.obs_normalizer.shift += 1.0                     # the policy's statistics differ from the dataset's
    seen, loss = [], policy.flow.loss
    monkeypatch.setattr(policy.flow, "loss", lambda act, obs, weight=None: (seen.append(obs.cpu()), loss(act, obs))[1])
    bc.train(cfg, dataset, tmp_path, policy=policy)
    seen = torch.cat(seen).flatten(1)                      # [2 * batch, To * O]
    as_policy = dataset.tensors(policy.obs_normalizer.cpu(), policy.action_normalizer.cpu())[0].flatten(1)
    as_dataset = dataset.tensors()[0].flatten(1)
    exact = "donot_use_mm_for_euclid_dist"
    assert torch.cdist(seen, as_policy, compute_mode=exact).min(1).values.max() < 1e-5  # each row a policy window
    assert torch.cdist(seen, as_dataset, compute_mode=exact).min(1).values.min() > 1.0


def test_checkpoint_round_trip_gives_the_same_actions(tmp_path):
    cfg = tiny_cfg(train_steps=5)
    policy, _ = bc.train(cfg, ChunkDataset(random_episodes(), 2, 16), tmp_path)
    loaded = bc.load_policy(tmp_path / "last.pt")
    obs = torch.randn(3, 2, OBS_DIM)
    a = policy.cpu().act(obs, 4, torch.Generator().manual_seed(0))  # trained on the GPU if any
    b = loaded.act(obs, 4, torch.Generator().manual_seed(0))
    assert a.shape == (3, cfg.act_horizon, ACT_DIM) and torch.allclose(a, b)
    assert (tmp_path / "best_model.pt").exists()


@pytest.mark.parametrize("decay", [0.0, 0.9])
def test_ema_decay_0_samples_the_trained_net_itself_and_a_decay_samples_its_average(tmp_path, decay):
    """``ema_decay: 0`` (no EMA, the toolkit's stage-1 row) keeps no averaged copy: the policy acts with the trained
    net, and its checkpoint loads as the same policy; with a decay the sampled net is the average, not the net."""
    cfg = tiny_cfg(train_steps=5, ema_decay=decay)
    policy, _ = bc.train(cfg, ChunkDataset(random_episodes(), 2, 16), tmp_path)
    flow = policy.flow
    assert (flow.ema is None) == (decay == 0)
    assert (flow.sampling_net() is flow.net) == (decay == 0)
    if decay:
        live = torch.cat([p.flatten() for p in flow.net.parameters()])
        assert not torch.equal(live, torch.cat([p.flatten() for p in flow.sampling_net().parameters()]))
    loaded = bc.load_policy(tmp_path / "last.pt")
    obs = torch.randn(3, 2, OBS_DIM)
    assert torch.equal(policy.cpu().act(obs, 4, torch.Generator().manual_seed(0)),
                       loaded.act(obs, 4, torch.Generator().manual_seed(0)))


def test_a_resumed_run_without_periodic_evaluation_writes_its_final_policy_as_best_model(tmp_path):
    """eval_every 0: best_model.pt is the last policy, also after a resume (it was the first part's)."""
    dataset = ChunkDataset(random_episodes(), 2, 16)
    bc.train(tiny_cfg(train_steps=10), dataset, tmp_path)
    assert bc.read_checkpoint(tmp_path / "best_model.pt")["step"] == 10
    bc.train(tiny_cfg(train_steps=20), dataset, tmp_path)  # resumes from last.pt at step 10
    assert bc.read_checkpoint(tmp_path / "best_model.pt")["step"] == 20


def test_keep_every_keeps_each_steps_policy_and_leaves_the_run_unchanged(tmp_path):
    """``step_<N>.pt`` holds the policy as it was at step N, and keeping them changes nothing about the run."""
    dataset = ChunkDataset(random_episodes(), 2, 16)
    plain, _ = bc.train(tiny_cfg(), dataset, tmp_path / "plain")
    kept, _ = bc.train(tiny_cfg(keep_every=5), dataset, tmp_path / "kept")
    assert sorted(p.name for p in (tmp_path / "kept").glob("step_*.pt")) == [f"step_{n}.pt" for n in (10, 15, 20, 5)]
    assert not list((tmp_path / "plain").glob("step_*.pt"))
    for p, q in zip(plain.flow.parameters(), kept.flow.parameters()):
        assert torch.equal(p, q)
    at_end = bc.load_policy(tmp_path / "kept" / "step_20.pt")
    for p, q in zip(kept.cpu().flow.parameters(), at_end.flow.parameters()):
        assert torch.equal(p, q)
    assert bc.read_checkpoint(tmp_path / "kept" / "step_10.pt")["step"] == 10
    mid = bc.load_policy(tmp_path / "kept" / "step_10.pt")
    assert any(not torch.equal(p, q) for p, q in zip(mid.flow.parameters(), at_end.flow.parameters()))


def test_a_killed_run_resumes_from_last_and_ends_where_an_unbroken_run_ends(tmp_path):
    dataset = ChunkDataset(random_episodes(), 2, 16)
    cfg = tiny_cfg()
    unbroken, _ = bc.train(cfg, dataset, tmp_path / "a")

    class KillAt15:
        rows = []

        def log(self, metrics, step):
            if step == 15:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        bc.train(cfg, dataset, tmp_path / "b", tracker=KillAt15())
    assert bc.read_checkpoint(tmp_path / "b" / "last.pt")["step"] == 10  # lost at most one interval
    resumed, _ = bc.train(cfg, dataset, tmp_path / "b")
    for p, q in zip(unbroken.flow.parameters(), resumed.flow.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


def test_resume_refuses_a_checkpoint_of_other_settings(tmp_path):
    dataset = ChunkDataset(random_episodes(), 2, 16)
    bc.train(tiny_cfg(train_steps=2), dataset, tmp_path)
    with pytest.raises(ValueError, match="other settings"):
        bc.train(tiny_cfg(train_steps=2, emb_dim=16), dataset, tmp_path)


def test_missing_or_foreign_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="notebook 01"):
        bc.load_policy(tmp_path / "missing.pt")
    torch.save({"weights": 1}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a flowlib flow-policy checkpoint"):
        bc.load_policy(tmp_path / "other.pt")
    whole = (tmp_path / "other.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(whole[: len(whole) // 2])  # a copy cut short
    with pytest.raises(ValueError, match="cut.pt is not a readable torch checkpoint .*pass a best_model.pt"):
        bc.load_policy(tmp_path / "cut.pt")


def test_checkpoint_and_env_dims_must_match(tmp_path):
    bc.train(tiny_cfg(train_steps=1), ChunkDataset(random_episodes(), 2, 16), tmp_path)
    ok = EnvSpec("PickCube-v1", OBS_DIM, ACT_DIM, "pd_ee_delta_pos", 100)
    bc.load_policy(tmp_path / "last.pt", ok)
    with pytest.raises(ValueError, match="obs_dim=42 but the env has obs_dim=48"):
        bc.load_policy(tmp_path / "last.pt", dataclasses.replace(ok, obs_dim=48))
    with pytest.raises(ValueError, match="trained on PickCube-v1, env is StackCube-v1"):
        bc.load_policy(tmp_path / "last.pt", dataclasses.replace(ok, env_id="StackCube-v1"))


def test_unknown_env_id_suggests_real_ones():
    with pytest.raises(ValueError, match="PickCube-v1"):
        check_env_id("PickCub-v1")


def test_physx_gpu_library_out_of_reach_is_a_clear_error(monkeypatch):
    """SAPIEN downloads its PhysX GPU library on first use; offline that must name the file and the fallback."""
    import requests
    import sapien.physx

    from flowlib.envs import maniskill as envs

    def offline():
        raise requests.exceptions.ConnectionError("Could not resolve host: github.com")

    monkeypatch.setattr(sapien.physx, "enable_gpu", offline)
    with pytest.raises(RuntimeError, match=r"libPhysXGpu_64\.so.*backend='physx_cpu'") as info:
        envs.enable_physx_gpu()
    assert sapien.physx.version() in str(info.value) and "ConnectionError" in str(info.value)


TASK_FLAGS = {"PickCube-v1": {"is_grasped", "is_obj_placed", "is_robot_static"}, "PushCube-v1": set(),
              "StackCube-v1": {"is_cubeA_grasped", "is_cubeA_on_cubeB", "is_cubeA_static"}}


@pytest.mark.sim
@pytest.mark.parametrize("env_id", ["PickCube-v1", "PushCube-v1", "StackCube-v1"])
def test_real_maniskill_env_on_cpu_has_the_batched_interface(env_id):
    with make_env(env_id, 1, max_episode_steps=5) as env:
        obs = env.reset(seed=0)
        assert obs.shape == (1, env.spec.obs_dim) and obs.dtype == torch.float32
        assert env.spec.action_dim == 4 and env.backend == "physx_cpu"
        for _ in range(5):
            obs, reward, terminated, truncated, success = env.step(torch.zeros(1, 4))
        assert reward.shape == terminated.shape == success.shape == (1,)
        assert truncated.tolist() == [True]  # the time limit, not termination
        assert set(env.task_flags) == TASK_FLAGS[env_id]  # the task's evaluation flags other than success
        assert all(f.dtype == torch.bool and f.shape == (1,) for f in env.task_flags.values())
        if env_id == "PickCube-v1":  # the gripper opened in place: nothing grasped, the arm at rest
            assert env.task_flags["is_grasped"].tolist() == [False] and env.task_flags["is_robot_static"].tolist() == [True]
        with pytest.raises(ValueError, match=r"action must be \[1, 4\]"):
            env.step(torch.zeros(1, 3))


def grasp_cubes(env, obs, steps=20):
    """Scripted PickCube from ``obs [N, O]``: each gripper goes down onto its cube (open), closes at step 10
    and lifts it; the last observation."""
    for t in range(steps):
        cube = obs[:, PICKCUBE_TCP_TO_OBJ]  # [N, 3] cube - gripper, m; an action of 1 asks for 10 cm
        action = torch.zeros(env.num_envs, 4)
        action[:, :3] = (cube / 0.1).clamp(-1, 1) if t < 15 else torch.tensor([0.0, 0.0, 0.5])
        action[:, 3] = 1.0 if t < 10 else -1.0  # open, then close
        obs, *_ = env.step(action)
    return obs


@pytest.mark.sim
def test_a_reset_does_not_carry_the_previous_episodes_grasp_into_the_first_observation():
    with make_env("PickCube-v1", 2, max_episode_steps=50, backend="physx_cpu") as env:
        obs = grasp_cubes(env, env.reset(seed=[0, 1]))
        assert env.task_flags["is_grasped"].tolist() == [True, True] and obs[:, PICKCUBE_GRASPED].tolist() == [1, 1]
        raw, _ = env.env.reset(seed=[2, 3])  # ManiSkill's own reset reads the last episode's contacts
        assert raw[:, PICKCUBE_GRASPED].tolist() == [1, 1]
        grasp_cubes(env, torch.as_tensor(raw, dtype=torch.float32))
        first = env.reset(seed=[2, 3])  # the same first observation, the grasp cleared
        assert first[:, PICKCUBE_GRASPED].tolist() == [0, 0]
        keep = [i for i in range(first.shape[1]) if i != PICKCUBE_GRASPED]
        assert torch.allclose(first[:, keep], torch.as_tensor(raw[:, keep], dtype=torch.float32))
        grasp_cubes(env, first)
        obs = env.reset_some(torch.tensor([True, False]), [4, 5])  # env 0 starts over, env 1 still holds its cube
        assert obs[0, PICKCUBE_GRASPED] == 0
        obs, *_ = env.step(torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, -1.0]]))
        assert env.task_flags["is_grasped"].tolist() == [False, True] and obs[:, PICKCUBE_GRASPED].tolist() == [0, 1]


def carry_episode(env, seed, steps=50):
    """One env's scripted PickCube episode, observations ``[steps + 1, O]``: the open gripper goes to its cube for 25
    steps, then closes and carries it towards the goal."""
    obs, out = env.reset(seed=[seed]), []
    for t in range(steps):
        out.append(obs[0])
        target = PICKCUBE_TCP_TO_OBJ if t < 25 else PICKCUBE_OBJ_TO_GOAL  # [3], m; an action of 1 asks for 10 cm
        action = torch.zeros(1, 4)
        action[:, :3] = (obs[:, target] / 0.1).clamp(-1, 1)
        action[:, 3] = 1.0 if t < 25 else -1.0
        obs, *_ = env.step(action)
    return torch.stack(out + [obs[0]]).numpy()


@pytest.mark.sim
def test_a_fresh_scene_runs_an_episode_the_same_whatever_ran_before_it(monkeypatch):
    """PhysX keeps contact state across a physx_cpu reset that ManiSkill's state dict does not show: on the machines
    here episode 3 after episodes 1 and 2 grips differently the second time round (from step 26; 5 cm by step 50).
    With ``fresh_scene`` each reset builds a new scene, and the episode repeats bit for bit."""
    with make_env("PickCube-v1", 1, max_episode_steps=50, backend="physx_cpu", fresh_scene=True) as env:
        assert env.env.envs[0].unwrapped.reconfiguration_freq == 1  # the option reached the worker's env
        runs = []
        for _ in range(2):
            for seed in (1, 2):
                carry_episode(env, seed)
            runs.append(carry_episode(env, 3))
    np.testing.assert_array_equal(runs[0], runs[1])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # refused before anything touches the GPU
    with pytest.raises(ValueError, match="fresh_scene.*physx_cpu"):
        make_env("PickCube-v1", 2, fresh_scene=True)  # auto: physx_cuda where there is a GPU


@pytest.mark.sim
def test_policy_rolls_in_a_real_pickcube_env(tmp_path):
    policy, _ = bc.train(tiny_cfg(train_steps=2), ChunkDataset(random_episodes(), 2, 16), tmp_path)
    with make_env("PickCube-v1", 1, max_episode_steps=10) as env:
        bc.check_compatible(policy.meta, env.spec)
        result = bc.evaluate(policy, env, num_episodes=1, num_inference_steps=2, seed=0)
    assert set(result) >= {"success_once", "success_at_end", "return", "env_steps_per_s"}
    assert result["episodes"] == 1 and 0 <= result["success_at_end"] <= result["success_once"] <= 1


class FlagsAtStep:
    """Two scripted envs of 4 steps whose task flag ``is_grasped`` is true at one step of env 0 only."""

    num_envs, device, max_episode_steps = 2, torch.device("cpu"), 4

    def __init__(self, at: int):
        self.at, self.t, self.task_flags = at, 0, {}

    def reset(self, seed=None):
        self.t = 0
        return torch.zeros(2, OBS_DIM)

    def step(self, action):
        self.t += 1
        self.task_flags = {"is_grasped": torch.tensor([self.t == self.at, False])}
        no = torch.zeros(2, dtype=torch.bool)
        return torch.zeros(2, OBS_DIM), torch.zeros(2), no, torch.full((2,), self.t == 4), no


def test_evaluate_counts_a_task_flag_once_per_episode(tmp_path):
    """A flag true at a single step counts for its episode; the unused env of the last batch is dropped."""
    policy, _ = bc.train(tiny_cfg(train_steps=2), ChunkDataset(random_episodes(), 2, 16), tmp_path)
    for at in (2, 4):  # mid-chunk and the episode's last step
        result = bc.evaluate(policy, FlagsAtStep(at), num_episodes=3, num_inference_steps=2)
        assert result["per_episode_flags_once"] == {"is_grasped": [True, False, True]}
        assert result["flags_once"] == {"is_grasped": pytest.approx(2 / 3)}
    never = bc.evaluate(policy, FlagsAtStep(5), num_episodes=3, num_inference_steps=2)
    assert never["flags_once"] == {"is_grasped": 0.0}


@pytest.mark.sim
def test_noisy_rollouts_are_recorded_as_episodes(tmp_path):
    policy, _ = bc.train(tiny_cfg(train_steps=2), ChunkDataset(random_episodes(), 2, 16), tmp_path)
    with make_env("PickCube-v1", 2, max_episode_steps=10) as env:
        quiet = bc.evaluate(policy, env, 3, 2, seed=0, record=True)
        noisy = bc.evaluate(policy, env, 3, 2, seed=0, action_noise_std=0.5, record=True)
    assert len(quiet["rollouts"]) == 3  # the fourth env of the second batch is dropped
    assert [ep.seed for ep in quiet["rollouts"]] == [0, 1, 2]
    ep, ep_noisy = quiet["rollouts"][0], noisy["rollouts"][0]
    assert ep.obs.shape == (11, OBS_DIM) and ep.actions.shape == (10, ACT_DIM) and ep.rewards.shape == (10,)
    assert ep.truncated.tolist() == [False] * 9 + [True] and (ep.terminated == ep.success).all()
    assert np.abs(ep_noisy.actions).max() <= 1 and not np.allclose(ep.actions, ep_noisy.actions)
    assert np.allclose(ep.obs[0], ep_noisy.obs[0])  # same env seeds


@pytest.mark.sim
def test_an_episode_does_not_depend_on_how_episodes_are_batched(tmp_path):
    """Episode i's env seed and policy noise both come from seed + i, so 1 env and 2 envs run the same episodes."""
    policy, _ = bc.train(tiny_cfg(train_steps=2), ChunkDataset(random_episodes(), 2, 16), tmp_path)
    runs = {}
    for num_envs in (1, 2):
        with make_env("PickCube-v1", num_envs, max_episode_steps=10) as env:
            runs[num_envs] = bc.evaluate(policy, env, 3, 2, seed=5, action_noise_std=0.3, record=True)["rollouts"]
    for one, two in zip(runs[1], runs[2], strict=True):
        assert one.seed == two.seed
        # CUDA's kernels vary with the batch size by ~1e-5; on the CPU the episodes match to 1e-5
        np.testing.assert_allclose(one.actions, two.actions, atol=1e-4 if torch.cuda.is_available() else 1e-5)
        np.testing.assert_allclose(one.obs, two.obs, atol=1e-4)


def test_the_mlp_velocity_net_maps_chunks_to_chunks_and_refuses_other_shapes():
    from flowlib.flows.unet import ChunkVelocityMLP

    net = ChunkVelocityMLP(ACT_DIM, OBS_DIM, 2, 16, hidden=(32, 24), emb_dim=8)
    x, t, obs = torch.randn(5, 16, ACT_DIM), torch.rand(5), torch.randn(5, 2, OBS_DIM)
    velocity, features = net(x, t, t, obs, return_features=True)
    assert velocity.shape == (5, 16, ACT_DIM) and features.shape == (5, 24)
    with pytest.raises(ValueError, match=r"obs must be \[B, 2, 42\]"):
        net(x, t, t, torch.randn(5, 3, OBS_DIM))


def test_an_mlp_policy_trains_round_trips_and_an_old_checkpoint_reads_as_a_unet(tmp_path):
    cfg = tiny_cfg(train_steps=5, velocity_net="mlp", mlp_dims=[32, 32])
    policy, _ = bc.train(cfg, ChunkDataset(random_episodes(), 2, 16), tmp_path)
    loaded = bc.load_policy(tmp_path / "last.pt")
    assert type(loaded.flow.net).__name__ == "ChunkVelocityMLP" and bc.features_dim(loaded.meta) == 32
    obs = torch.randn(3, 2, OBS_DIM)
    assert torch.allclose(policy.cpu().act(obs, 4, torch.Generator().manual_seed(0)),
                          loaded.act(obs, 4, torch.Generator().manual_seed(0)))
    old = {k: v for k, v in policy.meta.items() if k not in ("velocity_net", "mlp_dims")}  # a checkpoint of before
    assert bc.complete_meta(old)["velocity_net"] == "unet"
    with pytest.raises(ValueError, match="velocity_net must be one of"):
        tiny_cfg(velocity_net="transformer")


def test_a_diverging_run_stops_with_the_step_and_the_fix_and_keeps_its_last_checkpoint(tmp_path):
    """At lr 1e30 the first step throws the weights to ~1e30 and the next gradient is not finite: training stops
    there, before the optimiser applies it, and ``last.pt`` (step 1) holds finite weights."""
    dataset = ChunkDataset(random_episodes(), 2, 16)
    with pytest.raises(FloatingPointError, match=r"velocity net's gradient norm is (nan|inf) at step \d+: lower lr"):
        bc.train(tiny_cfg(lr=1e30, train_steps=20, ckpt_every=1), dataset, tmp_path)
    ckpt = bc.read_checkpoint(tmp_path / "last.pt")
    assert all(torch.isfinite(v).all() for v in ckpt["flow"].values() if v.is_floating_point())
