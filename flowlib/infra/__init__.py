"""infra: what every run needs, with no flowlib import below it (the bottom layer).

    config       typed, validated parameters (unknown keys, wrong types, out-of-range and NaN values rejected)
    runs         run folders under outputs/, atomic writes, checkpoints loaded with errors that say what is wrong
    tracking     metrics to files, optionally W&B (offline by default)
    progress     progress bars in JupyterLab and a terminal, plain lines in a headless run
    guards       a NaN / inf loss or gradient stops a run before the optimiser applies it
    sysdeps      system packages the simulators need (`make system-deps`)
    lab          JupyterLab as `make lab` runs it: strip on save, idle kernels culled
    schedules    the learning-rate and exploration-noise schedules over training progress, defined once
    metrics      distances between sample sets (sliced Wasserstein); paired and clustered standard errors
    grad_signal  how much of a stochastic gradient is signal (independent estimates: mean and noise)
"""
