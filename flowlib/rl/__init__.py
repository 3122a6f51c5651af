"""rl: what every stage-3 method shares (imports the layers below).

    advantages  returns and advantages over chunk decisions: GAE, Monte-Carlo, n-step, GRPO, branch; reward scaling
    ppo         PPO's config, the clipped surrogate with dual clip, the (Huber, clipped) value loss, the update
    buffers     stage 3's rollout buffer (advantages by ppo's estimators) and replay buffer
    loop        stage 3's one training loop, RunConfig, checkpoints, resume, validation
    learners    the two learner families the loop drives: PPOLearner (on-policy) and ReplayLearner (off-policy)
    asymmetric  critics that read the simulator's state while a visual actor reads the camera (Q or V)
"""
