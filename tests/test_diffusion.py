"""Stage 1's diffusion baseline (``flowlib.flows.diffusion.DDPM``): its schedule, its noise-prediction loss at a known
timestep, its DDPM and DDIM samplers, and its place among the policies (config, checkpoint, the stages that refuse
it, ``flowlib.evaluate --sampler``)."""
import dataclasses
import math

import pytest
import torch

from flowlib.envs.data import ChunkDataset
from flowlib.flows.diffusion import DDPM, SAMPLERS, row_generators
from flowlib.flows.nets import ConditionalMLP
from flowlib.methods import stage3
from flowlib.policies import bc, chunk_policy
from flowlib.tools import evaluate as evaluate_tool
from flowlib.tools import run
from test_bc import ACT_DIM, OBS_DIM, random_episodes, tiny_cfg

T = 100


class PointMassOracle(torch.nn.Module):
    """The exact noise prediction for data that is always ``c``: ``eps = (x_k - sqrt(abar_k) c) / sqrt(1 - abar_k)``,
    reading the integer timestep back from the net's ``t = k / T``: wrong wiring of timesteps shows in its samples."""

    def __init__(self, c: torch.Tensor):
        super().__init__()
        self.c, self.model = c, None
        self.unused = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x, t, d, obs=None):
        k = (t * T).round().long()
        abar = self.model.schedulers["ddpm"].alphas_cumprod[k].reshape(-1, *[1] * (x.dim() - 1))
        return (x - abar.sqrt() * self.c) / (1 - abar).sqrt()


def oracle_model(c):
    net = PointMassOracle(c)
    model = DDPM(net, ema_decay=None, num_train_timesteps=T)
    net.model = model
    return model


def test_the_schedule_is_the_squared_cosine_of_improved_ddpm():
    """``abar_k = f(k + 1) / f(0)``, ``f(t) = cos^2(((t / T) + s) / (1 + s) * pi / 2)``, s = 0.008 (Nichol & Dhariwal
    2021, Eq. 17; diffusers indexes it from k + 1), away from the last steps where beta is capped at 0.999."""
    model = DDPM(ConditionalMLP(2, hidden=8, depth=1, emb_dim=4), num_train_timesteps=T)
    f = lambda t: math.cos((t / T + 0.008) / 1.008 * math.pi / 2) ** 2  # noqa: E731
    expected = torch.tensor([f(k + 1) / f(0) for k in range(90)], dtype=torch.float64)
    torch.testing.assert_close(model.schedulers["ddpm"].alphas_cumprod[:90].double(), expected, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(model.schedulers["ddim"].alphas_cumprod, model.schedulers["ddpm"].alphas_cumprod)


def test_the_noise_prediction_loss_at_a_known_timestep_on_a_hand_made_batch():
    """Data all ones, k = 50 for every sample, given noise: a net that returns that noise scores 0, one that is off by
    0.5 everywhere scores 0.25, one that returns zeros scores the noise's mean square (Ho et al. 2020, Eq. 14)."""
    x1 = torch.ones(4, 16, 2)
    noise = torch.randn(4, 16, 2, generator=torch.Generator().manual_seed(0))
    k = torch.full((4,), 50)

    class Answers(torch.nn.Module):
        def __init__(self, offset):
            super().__init__()
            self.offset, self.seen = offset, None
            self.unused = torch.nn.Parameter(torch.zeros(1))

        def forward(self, x, t, d, obs=None):
            self.seen = (x, t, d)
            return noise + self.offset if self.offset is not None else torch.zeros_like(x)

    for offset, expected in ((0.0, 0.0), (0.5, 0.25), (None, noise.pow(2).mean().item())):
        net = Answers(offset)
        model = DDPM(net, ema_decay=None, num_train_timesteps=T)
        loss, info = model.loss(x1, timesteps=k, noise=noise)
        assert loss.item() == pytest.approx(expected, abs=1e-6) and info["loss"] == pytest.approx(expected, abs=1e-6)
    abar = model.schedulers["ddpm"].alphas_cumprod[50]
    x_k, t, d = net.seen
    torch.testing.assert_close(x_k, abar.sqrt() * x1 + (1 - abar).sqrt() * noise)  # Eq. 4
    assert torch.equal(t, torch.full((4,), 0.5)) and torch.equal(d, torch.zeros(4))


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("steps", [100, 10, 4, 1])
def test_each_sampler_recovers_a_point_mass_at_every_step_count(sampler, steps):
    c = torch.tensor([0.3, -0.7])
    model = oracle_model(c)
    model.sampler = sampler
    x = model.sample(torch.randn(6, 2, generator=torch.Generator().manual_seed(1)), steps)
    torch.testing.assert_close(x, c.expand(6, 2), atol=1e-3, rtol=0)


def test_a_wrong_step_count_or_sampler_is_refused_with_the_range():
    model = oracle_model(torch.zeros(2))
    with pytest.raises(ValueError, match=r"num_steps must be in \[1, 100\]"):
        model.sample(torch.randn(2, 2), 101)
    with pytest.raises(ValueError, match="sampler must be one of"):
        model.sampler = "euler"


def test_the_ddpm_chain_is_a_function_of_its_start_whatever_the_batch():
    """DDPM's per-step noise comes from each row's x_0: reordering the batch reorders the chunks, a repeated start gives
    the same chunk, and two starts get different noise (the chain is stochastic)."""
    torch.manual_seed(0)
    model = DDPM(ConditionalMLP(3, hidden=16, depth=1, emb_dim=4), ema_decay=None, clip_range=0)
    model.sampler = "ddpm"
    x0 = torch.randn(4, 3)
    out = model.sample(x0, 10)
    torch.testing.assert_close(model.sample(x0[[3, 1]], 10), out[[3, 1]])
    torch.testing.assert_close(model.sample(x0[[2, 2]], 10), out[[2, 2]])
    g = row_generators(x0)
    assert not torch.equal(torch.randn(3, generator=g[0]), torch.randn(3, generator=g[1]))


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_the_clamp_bounds_what_an_untrained_net_samples_and_without_it_the_first_step_blows_up(sampler):
    """At k = 99 the predicted data is the noise error times 1 / sqrt(abar) ~ 2,000: the clamp keeps every step's
    prediction, and so the sample, inside [-clip_range, clip_range]."""
    torch.manual_seed(0)
    net = ConditionalMLP(3, hidden=16, depth=1, emb_dim=4)
    x0 = torch.randn(64, 3, generator=torch.Generator().manual_seed(0))
    for clip_range in (2.5, 0.0):
        model = DDPM(net, ema_decay=None, clip_range=clip_range)
        model.sampler = sampler
        x = model.sample(x0, 10)
        assert bool(x.abs().max() <= 2.5) is (clip_range > 0)


def test_standardised_actions_are_clamped_at_the_demos_largest_and_min_max_ones_at_one():
    dataset = ChunkDataset(random_episodes(), 2, 16, action_norm="meanstd")
    meta = bc.policy_meta(tiny_cfg(model="ddpm", action_norm="meanstd"), dataset, "pd_ee_delta_pos")
    largest = dataset.tensors()[1].abs().max().item()
    assert largest > 1.0 and meta["diffusion_clip_sample"] == pytest.approx(largest, abs=1e-3)
    minmax = ChunkDataset(random_episodes(), 2, 16, action_norm="minmax")
    assert bc.policy_meta(tiny_cfg(model="ddpm"), minmax, "pd_ee_delta_pos")["diffusion_clip_sample"] == 1.0


def test_a_small_ddpm_learns_two_points_and_its_loss_goes_down():
    """Data at +1 or -1 (two modes): after training, DDIM's samples land near one of them, on both sides."""
    torch.manual_seed(0)
    model = DDPM(ConditionalMLP(1, hidden=64, depth=2, emb_dim=16), ema_decay=None)
    opt = torch.optim.Adam(model.net.parameters(), 3e-3)
    losses = []
    for _ in range(600):
        x1 = torch.randint(0, 2, (256, 1)).float() * 2 - 1
        loss, _ = model.loss(x1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-50:]) < 0.6 * sum(losses[:50])
    model.sampler = "ddim"
    x = model.sample(torch.randn(400, 1, generator=torch.Generator().manual_seed(0)), 10)
    assert (x - x.sign()).abs().median() < 0.1 and 0.25 < (x > 0).float().mean() < 0.75


def test_the_config_checks_step_counts_against_the_model():
    with pytest.raises(ValueError, match="exceed the DDPM's diffusion_steps=50"):
        bc.ShortCutBCConfig(model="ddpm", diffusion_steps=50, eval_inference_steps=[100], diffusion_eval_steps=[10])
    with pytest.raises(ValueError, match="diffusion_eval_steps .100. exceed diffusion_steps=50"):
        bc.ShortCutBCConfig(diffusion_steps=50)
    with pytest.raises(ValueError, match="model must be one of"):
        bc.ShortCutBCConfig(model="vae")
    bc.ShortCutBCConfig(model="ddpm", eval_inference_steps=[100, 10, 3])  # any K <= T: no power of two needed
    twin = bc.diffusion_twin(tiny_cfg(select_inference_steps=4))
    assert (twin.model, twin.eval_inference_steps, twin.train_steps) == ("ddpm", [100, 10, 4, 1], 20)


def test_a_shortcut_policy_keeps_the_metadata_it_had_before_the_diffusion_fields():
    """A ShortCut run's meta holds the defaults whatever the diffusion fields say, so a checkpoint written before
    them (completed by ``META_DEFAULTS``) resumes as the same run."""
    dataset = ChunkDataset(random_episodes(), 2, 16, action_norm="meanstd")
    meta = bc.policy_meta(tiny_cfg(action_norm="meanstd", diffusion_sampler="ddpm"), dataset, "pd_ee_delta_pos")
    old = {k: v for k, v in meta.items() if k not in chunk_policy.META_DEFAULTS_MODEL}
    assert chunk_policy.complete_meta(old) == meta


@pytest.fixture
def ddpm_checkpoint(tmp_path):
    cfg = tiny_cfg(model="ddpm", train_steps=6, eval_inference_steps=[10, 1], select_inference_steps=1)
    policy, _ = bc.train(cfg, ChunkDataset(random_episodes(), 2, 16), tmp_path)
    return policy.cpu(), tmp_path / "best_model.pt"


def test_a_ddpm_checkpoint_saves_and_loads_as_the_same_policy_for_either_sampler(ddpm_checkpoint):
    policy, path = ddpm_checkpoint
    loaded = bc.load_policy(path)
    assert isinstance(loaded.flow, DDPM) and loaded.flow.sampler == "ddim"  # the run's diffusion_sampler
    obs = torch.randn(3, 2, OBS_DIM)
    for sampler in SAMPLERS:
        policy.flow.sampler = loaded.flow.sampler = sampler
        a = policy.act(obs, 10, torch.Generator().manual_seed(0))
        assert a.shape == (3, 8, ACT_DIM) and torch.allclose(a, loaded.act(obs, 10, torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("notebook, key", [("02_aw_shortcut", "stage1_checkpoint"), ("03_reinflow", "init_checkpoint"),
                                           ("06_steering", "init_checkpoint"), ("04_flow_sde", "init_checkpoint")])
def test_every_later_stage_refuses_a_ddpm_start_in_one_line_before_a_kernel(ddpm_checkpoint, notebook, key, capsys):
    _, path = ddpm_checkpoint
    assert run.main([notebook, "-p", f"{key}={path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {key}: {path} is stage 1's diffusion baseline (model: ddpm)")
    assert "start from a stage-1 run with model: shortcut" in err and err.count("\n") == 1
    problem = stage3.start_problem(stage3.Stage3Config(init_checkpoint=str(path)))  # stage 3's own check, as a sweep
    assert "diffusion baseline (model: ddpm); stage 3 reads a ShortCut flow" in problem and "\n" not in problem


def test_flowlib_evaluate_scores_a_ddpm_with_each_sampler_and_a_flow_once(ddpm_checkpoint, tmp_path):
    policy, _ = ddpm_checkpoint
    flow, _ = bc.train(tiny_cfg(train_steps=2), ChunkDataset(random_episodes(), 2, 16), tmp_path / "flow")
    assert evaluate_tool.samplers_of(policy, ["ddpm", "ddim"]) == ["ddpm", "ddim"]
    assert evaluate_tool.samplers_of(flow, ["ddpm", "ddim"]) == [None] == evaluate_tool.samplers_of(policy, None)
    assert evaluate_tool.label("run/best_model.pt", steps=100, sampler="ddim") == "run/best_model.pt@K100@ddim"
    with pytest.raises(ValueError, match="give each of"):
        evaluate_tool.evaluate_checkpoints([tmp_path / "flow" / "last.pt"], 2, 1, 0, 4, samplers=["euler"])


def test_the_twin_shares_everything_but_the_model():
    cfg = tiny_cfg()
    twin = bc.diffusion_twin(cfg)
    differ = {f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(twin, f.name)}
    assert differ == {"model", "compare_diffusion", "eval_inference_steps"}


@pytest.mark.parametrize("model, cls", [("reflow", "ReFlow"), ("meanflow", "MeanFlow")])
def test_plain_flows_train_as_stage_one_policies_load_back_and_are_refused_downstream(model, cls, tmp_path):
    """``model: reflow`` / ``meanflow``: the flows of notebook 00 over action chunks, sampled at any K (no power of
    two), saved and loaded as the same policy; the later stages, which read a ShortCut, refuse them by name."""
    cfg = tiny_cfg(model=model, train_steps=4, eval_inference_steps=[3, 16], select_inference_steps=3)
    policy, _ = bc.train(cfg, ChunkDataset(random_episodes(), 2, 16), tmp_path)
    loaded = bc.load_policy(tmp_path / "last.pt")
    assert type(loaded.flow).__name__ == cls
    obs = torch.randn(2, 2, OBS_DIM)
    torch.testing.assert_close(policy.cpu().act(obs, 3, torch.Generator().manual_seed(0)),
                               loaded.act(obs, 3, torch.Generator().manual_seed(0)))
    problem = stage3.start_problem(stage3.Stage3Config(init_checkpoint=str(tmp_path / "last.pt")))
    assert f"(model: {model}); stage 3 reads a ShortCut flow" in problem
