"""Every kind of checkpoint written so far keeps loading, and computes what it computed when it was written.

``tests/fixtures/checkpoints/`` holds small checkpoints of each kind, written by the code as of commit 2fea3be
(before stage 3 was split into an RL core and methods; the methods added since by ``add_method_fixtures.py``), and ``expected.pt`` what each computed then on fixed
windows: deterministic actions, sampled chains and their log-probs, values and Q values.  A refactor that changes
a state-dict key, a config field's meaning or a sampler's arithmetic fails here."""
from pathlib import Path

import pytest
import torch

from flowlib.methods import stage3
from flowlib.policies import bc
from flowlib.policies.awsc import load_from_aw_shortcut_flow

FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints"
STAGE3_KINDS = ("chain_ppo", "latent_ppo", "latent_sac", "residual_ppo", "residual_step_td3", "residual_step_ppo",
                "gaussian_ppo", "chain_rfc", "one_step_fql")  # the last three by fixtures/add_method_fixtures.py


@pytest.fixture(scope="module")
def expected():
    return torch.load(FIXTURES / "expected.pt", weights_only=False)


def close(a, b):
    return torch.allclose(a, b, rtol=1e-4, atol=1e-5)  # fixtures written with 2 torch threads, tests run with 1


def test_stage1_and_stage2_checkpoints_load():
    policy = bc.load_policy(FIXTURES / "stage1.pt")
    assert policy.meta["obs_dim"] == 42
    policy2, critic = load_from_aw_shortcut_flow(FIXTURES / "stage2.pt")
    assert critic is not None and critic.kind == "iql"
    assert load_from_aw_shortcut_flow(FIXTURES / "stage1.pt")[1] is None
    for a, b in zip(policy.flow.state_dict().values(), policy2.flow.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", STAGE3_KINDS)
def test_stage3_checkpoint_loads_and_computes_what_it_did(kind, expected):
    agent = stage3.load_agent(FIXTURES / f"{kind}.pt")
    windows, rec = expected["windows"], expected[kind]
    assert close(agent.act(windows, generator=torch.Generator().manual_seed(7)), rec["act"])
    with torch.no_grad():
        if "chunk" in rec:  # FQL's one-step policy and its critics
            o = agent.norm_obs(windows)
            z = torch.randn(len(o), agent.pred_horizon, agent.action_dim, generator=torch.Generator().manual_seed(9))
            assert close(agent.chunk(o, z), rec["chunk"])
            assert close(agent.q(o.flatten(1), agent.executed(rec["chunk"])), rec["q"])
        elif "correct_step" in rec:
            assert close(agent.correct_step(windows, rec["act"][:, 0]), rec["correct_step"])
            s = agent.state(windows, agent.action_normalizer.normalize(rec["act"][:, 0]))
            if "q" in rec:
                assert close(agent.critic(s, agent.residual(s)), rec["q"])
            else:
                r = torch.randn(6, 1, agent.action_dim, generator=torch.Generator().manual_seed(8))
                assert close(agent.residual_log_probs(s, r)[0], rec["residual_log_prob"])
                assert close(agent.state_value(s)[:, 0], rec["state_value"])
        else:
            chain, lp = agent.sample(windows, torch.Generator().manual_seed(9))
            stored = rec["chain"]
            if chain.shape[1] == 2 and stored.shape[1] > 2:
                # a steer of the frozen flow, written when it stored its decision as a whole chain: its draw was
                # step 0 and its chunk step K, the two rows of its decision now (flowlib.methods.steering)
                stored = stored[:, [0, -1]]
            assert close(chain, stored) and close(lp, rec["sample_log_prob"])
            assert close(agent.log_prob(windows, stored)[0], rec["log_prob"])
            if hasattr(agent, "value_net"):  # DSRL-SAC's agent carried an untrained V; it has its Q alone now
                assert close(agent.value(windows), rec["value"])
            if "q" in rec:
                assert close(agent.q(agent.norm_obs(windows).flatten(1), chain[:, 0].flatten(1)), rec["q"])


@pytest.mark.parametrize("kind", ["stage1", "stage2"])
def test_a_policy_checkpoint_is_refused_as_a_stage3_one(kind):
    with pytest.raises(ValueError, match="not a stage-3 checkpoint"):
        stage3.load_agent(FIXTURES / f"{kind}.pt")


def test_a_stage3_checkpoint_is_refused_as_a_policy():
    with pytest.raises(ValueError, match="not a flowlib flow-policy checkpoint"):
        bc.load_policy(FIXTURES / "chain_ppo.pt")


def test_a_chain_agent_runs_at_another_number_of_steps_and_a_steer_is_refused_in_one_line():
    """flowlib.tools.evaluate --steps: the fine-tuned chain at K steps of size 1/K; the agent's own K reproduces its act."""
    from flowlib.tools import evaluate
    agent = stage3.load_agent(FIXTURES / "chain_ppo.pt")
    window = torch.randn(3, agent.obs_horizon, agent.obs_dim)
    own = agent.act(window, generator=torch.Generator().manual_seed(0))
    K = agent.K
    agent.set_inference_steps(1)
    chain, _ = agent.sample(window, torch.Generator().manual_seed(0), deterministic=True)
    assert chain.shape[1] == 2 and agent.d == 1.0  # x_0 and one step of size 1
    agent.set_inference_steps(K)
    assert torch.equal(agent.act(window, generator=torch.Generator().manual_seed(0)), own)
    with pytest.raises(ValueError, match="outside \\[1, shortcut_max_steps"):
        agent.set_inference_steps(agent.meta["shortcut_max_steps"] + 1)
    with pytest.raises(ValueError, match="--steps applies to flow policies and chain ReinFlow agents"):
        evaluate.set_steps(stage3.load_agent(FIXTURES / "latent_ppo.pt"), 2, 4)
