"""methods: one module per stage-3 method, and the registry that names them (imports the layers below).

    chain_score     what the chain's log-prob scores: the dims of each step, how the steps reduce (ReinFlow Eq. 5)
    reinflow_agent  the noisy denoising chain as a policy, for every noise method (exact log-probs)
    reinflow        chain ReinFlow: ChainConfig, its rollouts (collect, branches), Monte-Carlo values
    steering        what every steer of a frozen flow is made of: the frozen flow's chain plus a small head
    latent          steer "latent": a Gaussian policy over the frozen flow's x_0 (DSRL's idea), learned by PPO
    latent_sac      the same policy over x_0 learned off-policy (DSRL's learner): twin Q, replay, KL to N(0, I)
    residual        steer "residual": a Gaussian correction of the frozen flow's executed actions per chunk (PPO)
    residual_step   steer "residual_step": a correction at every env step; the agent both learners share, the collector
    residual_td3    TD3 on that per-step correction (the CPU target run): the twin-Q agent and its learner
    residual_step_ppo  PPO on the same correction: the Gaussian agent with V, its rollouts as decisions
    gaussian        the baseline without a flow: a Gaussian MLP over the chunk, cloned from the demos, then PPO
    rfc             RFC, reflow fine-tuning with masks: the flow trained again on its own kept chunks
    fql             FQL, flow Q-learning: a one-step policy distilled from the flow and trained against Q
    registry        the registry: (steer, learner) -> configs, agent, learner; Stage3Config, the flat view
    stage3          build, load and train a Stage3Config's agent; the notebooks' configs

Adding a method is one module here plus one entry in ``registry.METHODS`` (docs/howto/extending.md).
"""
