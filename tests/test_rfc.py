"""RFC's masks select what they claim on hand-made batches (ties included), success is read from a sparse reward's
episodes, the ratio logged is the kept share, and the registry takes chain/rfc with its own checks."""
import pytest
import torch

from flowlib.methods import stage3
from flowlib.methods.rfc import episode_success, rfc_mask


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
    with pytest.raises(ValueError, match="does not read rfc_mask"):
        stage3.Stage3Config(rfc_mask="advantage_topk")
