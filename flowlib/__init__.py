"""flowlib: flow-matching policies and their RL fine-tuning, one vetted implementation of each algorithm.

Modules (each with one job), by layer, bottom to top; a module imports only from its own layer and the ones below
(tests/test_layers.py; docs/architecture.md draws them):

core: flows, nets, the SDE family, configs, runs
    flows     ReFlow, MeanFlow, ShortCut; the time convention (t = 0 noise, t = 1 data); the sampler
    nets      velocity networks with the interface net(x, t, d, obs)
    unet      ShortCutVelocityUNet1D, the 1D temporal U-Net over action chunks; ChunkVelocityMLP
    flow_sde  stochastic denoising steps: score from velocity, Flow-SDE, Flow-CPS, learned noise, hybrid masks
    toy2d     2D targets, the exact velocity of a Gaussian mixture, the notebook-00 experiment
    metrics   distances between sample sets (sliced Wasserstein); paired and clustered standard errors
    grad_signal  how much of a stochastic gradient is signal (independent estimates: mean and noise)
    schedules the learning-rate and exploration-noise schedules over training progress, defined once
    config    typed, validated parameters (unknown keys, wrong types, out-of-range and NaN values rejected)
    runs      run folders under outputs/, atomic writes
    tracking  metrics to files, optionally W&B (offline by default)
    progress  progress bars in JupyterLab and a terminal, plain lines in a headless run
    guards    a NaN / inf loss or gradient stops a run before the optimiser applies it
    sysdeps   system packages the simulators need (`make system-deps`)

world: tasks, simulators, demonstrations
    tasks     what is particular to each task, in one table (episode length, control mode, demo settings)
    envs      ManiSkill3 envs, batched torch interface (physx_cuda or AsyncVectorEnv on CPU); make_env for every backend
    metaworld_envs  Meta-World v3 (MuJoCo) tasks: seeded positions per episode, worker groups, the scripted experts
    fast_envs thousands of planar envs stepped as torch tensors (FastReach, FastPush), behind make_env's interface
    vector    gymnasium's vector envs as the CPU simulators use them; EnvGroups, a group of envs per worker process
    visual    RGB(-D) images and point clouds as packed observation vectors, from the env and from demos
    visual_demos  the state demos rendered into a visual obs mode, and their training windows
    data      motion-planning demos, trajectory files, normalisers, chunk windows
    smdp      action chunks as a semi-MDP: ChunkRunner steps N envs a chunk at a time, with the rewards learning sees

policy: stage 1 and 2
    encoders  observation encoders for pixels and points (a velocity net's obs_encoder)
    chunk_policy  the chunk-policy protocol, stage 1's FlowPolicy and the checkpoint format every stage loads
    policy_eval  scoring any chunk policy on held-out episodes (evaluate)
    bc        stage 1: ShortCut BC's config, demos and training loop (bc.<name> still reaches chunk_policy's)
    critic    chunk-level semi-MDP transitions, IQL / Monte-Carlo critics, AWR weights, RFC masks
    awsc      stage 2: AW-ShortCut data with contrast, load_from_aw_shortcut_flow

rl core: what every stage-3 method shares
    ppo       the PPO toolkit: GAE / MC / n-step / GRPO advantages, dual clip, Huber value clip, the update
    buffers   stage 3's rollout buffer (advantages by ppo's estimators) and replay buffer
    loop      stage 3's one training loop, RunConfig, checkpoints, resume, validation
    learners  the two learner families the loop drives: PPOLearner (on-policy) and ReplayLearner (off-policy)
    asymmetric  critics that read the simulator's state while a visual actor reads the camera (Q or V)

methods: one module per stage-3 method
    reinflow_agent  the noisy denoising chain as a policy, for every noise method (exact log-probs)
    reinflow  chain ReinFlow: ChainConfig, its rollouts (collect, branches), Monte-Carlo values, the policy gradient
    steering  what every steer of a frozen flow is made of: the frozen flow's chain plus a small head
    latent    steer "latent": a Gaussian policy over the frozen flow's x_0 (DSRL's idea), learned by PPO
    latent_sac  the same policy over x_0 learned off-policy (DSRL's learner): twin Q, replay, KL to N(0, I)
    residual  steer "residual": a Gaussian correction of the frozen flow's executed actions per chunk (PPO)
    residual_step  steer "residual_step": a correction at every env step; its agents, collector and PPO learner
    residual_td3   TD3 on that per-step correction (the CPU target run)
    gaussian  the baseline without a flow: a Gaussian MLP over the chunk, cloned from the demos, then PPO
    rfc       RFC, reflow fine-tuning with masks: the flow trained again on its own kept chunks
    fql       FQL, flow Q-learning: a one-step policy distilled from the flow and trained against Q

registry
    stage3    the registry of stage-3 methods ((steer, learner) -> configs, agent, learner), Stage3Config, build,
              load and train

tools: command lines and studies
    run       `python -m flowlib.run NOTEBOOK --params FILE`: papermill runner
    evaluate  `python -m flowlib.evaluate`: checkpoints on the same fresh episodes, differences paired per episode
    results   `python -m flowlib.results publish|check`: the files behind a published number, under results/
    seeds     `python -m flowlib.seeds`: a result over seeds from evaluate folders (spread, pooled rate)
    sweep     `python -m flowlib.sweep run|monitor`: notebook x params folder x seeds; the sweep report
    export    `python -m flowlib.export`: notebooks as HTML pages whose equations render offline
    bench     the policy's share of an env step, peak memory
    pirl      notebook 04's study: 2D marginal and log-prob tables, the noise-method comparison
"""
__version__ = "0.1.0"
