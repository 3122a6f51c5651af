"""flowlib: flow-matching policies and their RL fine-tuning, one vetted implementation of each algorithm.

Modules (each with one job):
    flows     ReFlow, MeanFlow, ShortCut; the time convention (t = 0 noise, t = 1 data); the sampler
    nets      velocity networks with the interface net(x, t, d, obs)
    metrics   distances between sample sets (sliced Wasserstein)
    toy2d     2D targets and the notebook-00 experiment
    config    typed, validated parameters (unknown keys and wrong types rejected)
    runs      run folders under outputs/, atomic writes
    tracking  metrics to files, optionally W&B (offline by default)
    run       `python -m flowlib.run NOTEBOOK --params FILE`: papermill runner
    sysdeps   system packages the simulator needs (`make system-deps`)
"""
__version__ = "0.1.0"
