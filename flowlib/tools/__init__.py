"""tools: command lines and studies, on top of everything (nothing in flowlib imports them).

    run       `python -m flowlib.run NOTEBOOK --params FILE`: papermill runner
    evaluate  `python -m flowlib.evaluate`: checkpoints on the same fresh episodes, differences paired per episode
    results   `python -m flowlib.results publish|tables|check`: the files behind a published number, under results/
    verdicts  a sweep's settings against its baseline, paired per seed on the same episodes (helps / hurts / none)
    seeds     `python -m flowlib.seeds`: a result over seeds from evaluate folders (spread, pooled rate)
    sweep     `python -m flowlib.sweep run|monitor`: notebook x params folder x seeds
    sweep_report  notebook 05's reading of a sweep: metrics, summaries, the table per setting over seeds
    export    `python -m flowlib.export`: notebooks as HTML pages whose equations render offline
    bench     the policy's share of an env step, peak memory
    pirl      notebook 04's study: 2D marginal and log-prob tables, the noise-method comparison

The commands keep their short names (`python -m flowlib.run`): flowlib/_moved.py maps them here.
"""
