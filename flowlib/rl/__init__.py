"""rl: what every stage-3 method shares (imports the layers below).

    ppo         the PPO toolkit: GAE / MC / n-step / GRPO advantages, dual clip, Huber value clip, the update
    buffers     stage 3's rollout buffer (advantages by ppo's estimators) and replay buffer
    loop        stage 3's one training loop, RunConfig, checkpoints, resume, validation
    learners    the two learner families the loop drives: PPOLearner (on-policy) and ReplayLearner (off-policy)
    asymmetric  critics that read the simulator's state while a visual actor reads the camera (Q or V)
"""
