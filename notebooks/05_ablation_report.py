# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: tags,-all
#     formats: ipynb,py:percent
#     notebook_metadata_filter: kernelspec,jupytext,-jupytext.text_representation.jupytext_version
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 05 · The ReinFlow ablation report
#
# Reads a sweep folder written by `python -m flowlib.sweep run 03_reinflow params/03_reinflow/ablations
# --seeds 0 1 2 ...` (22 settings x seeds, one notebook-03 run each) and reports, per setting and
# per category (warm-up, noise, PPO, learning rates, denoising steps, rollout shape):
#
# * **sample efficiency**: env steps until the training success rate first reaches `success_level`
#   (mean over the seeds that reach it, and how many do);
# * **final success**: the deterministic chain on the held-out evaluation seeds after training,
#   mean and spread (std) over seeds, and its gain over the start on the same episodes;
# * **stability**: the std of the success curve over the second half of each run, averaged over seeds;
# * **cost**: seconds per PPO iteration (rollout + update).
#
# With the default `sweep_dir = ""` the notebook first runs a two-setting smoke sweep of notebook
# 03 (`params/03_reinflow/smoke/`: chain PPO from notebook 01's default FastReach clone, 4 short iterations each, about
# 10 s), so that it always has real runs to read; point `sweep_dir` at a real sweep (e.g. `03_reinflow/ablations`,
# or `03_reinflow/toolkit` with `params/05_ablation_report/toolkit.yaml`) for the study itself.
#
# **Verdicts.** The runs' own before/after numbers are each on the run's evaluation episodes. To say whether a
# setting *helps*, its checkpoints and the baseline's are scored together on the same held-out episodes
# (`python -m flowlib.evaluate ... --seed 30000`, published under `results/` by `python -m flowlib.results publish`).
# With `evaluation` naming that record, the last section pairs every setting's seed `s` with the baseline's seed `s`
# episode by episode and averages over seeds (`flowlib.tools.verdicts`):
#
# $$d_{r,s} = \frac{1}{n}\sum_i \big[\mathrm{success}_i(r,s) - \mathrm{success}_i(\mathrm{baseline},s)\big], \qquad
# \mathrm{effect}_r = \frac{1}{S}\sum_s d_{r,s},$$
#
# with SE the larger of the seeds' spread $\mathrm{std}_s(d_{r,s})/\sqrt{S}$ and the episodes' noise
# $\sqrt{\sum_s \mathrm{se}_{r,s}^2}/S$: *helps* above $+2$ SE, *hurts* below $-2$ SE. The PPO toolkit sweep
# (`params/05_ablation_report/toolkit.yaml`, `docs/results/toolkit.md`) is read this way.

# %%
import matplotlib.pyplot as plt
import numpy as np

from flowlib.infra import config, runs
from flowlib.tools import sweep, sweep_report, verdicts
from flowlib.infra.runs import REPO_ROOT, outputs_root

# %% tags=["parameters"]
sweep_dir: str = ""  # relative to outputs/ (e.g. 03_reinflow/ablations); "" runs the smoke sweep
smoke_params: str = "params/03_reinflow/smoke"  # folder of params files the smoke sweep runs when sweep_dir is empty
seeds: list[int] = [0]  # seeds of the smoke sweep
success_level: float = 0.9  # success a run must reach to count as solved (time-to-level column)
metric: str = "train/success_once"  # the logged column the report compares
evaluation: str = ""  # results/<record> of the sweep's checkpoints on shared held-out episodes: paired verdicts
baseline: str = "baseline"  # the setting the verdicts compare every other with
run_name: str = "default"  # the run folder, outputs/<notebook>/<run_name>

# %%
cfg = config.from_globals(sweep_report.SweepReportConfig, globals())
run_path = runs.run_dir("05_ablation_report", cfg.run_name)
runs.save_params(run_path, cfg)
if cfg.sweep_dir:
    folder = outputs_root() / cfg.sweep_dir
else:  # the smoke sweep: real (short) runs, skipped when already finished
    sweep.run_sweep("03_reinflow", REPO_ROOT / cfg.smoke_params, cfg.seeds, sweep_name="smoke")
    folder = outputs_root() / "03_reinflow" / "smoke"
status = sweep.monitor(folder)
print(f"{folder.relative_to(outputs_root())}: " + ", ".join(f"{r['job']} {r['status']}" for r in status))

# %%
curves, finals = sweep_report.load_sweep(folder)
table = sweep_report.summarize(curves, finals, cfg.success_level, cfg.metric)
table.to_csv(run_path / "summary_table.csv", index=False)
table.round(3)

# %%
# NBVAL_CHECK_OUTPUT
print(f"one row per setting with finished runs: {len(table) == finals.variant.nunique()}")
print(f"final success within [0, 1]: {bool(table.final_success_mean.between(0, 1).all())}")

# %% [markdown]
# ## Per category: final success (mean ± std over seeds) and cost

# %%
by_cat = table.groupby("category")
fig, axes = plt.subplots(1, 2, figsize=(11, 0.45 * len(table) + 1.5))
labels = [f"{r.category} · {r.variant}" for r in table.itertuples()]
y = np.arange(len(table))
axes[0].barh(y, table.final_success_mean, xerr=table.final_success_std, color="tab:blue", alpha=0.8)
axes[0].set_yticks(y, labels)
axes[0].set_ylabel("category · variant")
axes[0].set_xlim(0, 1)
axes[0].axvline(finals.before.mean(), ls="--", c="k", lw=0.8)  # the start, on the same episodes
axes[0].set_xlabel(f"final success_once (mean +- std over {finals.seed.nunique()} seed(s); dashed: the start)")
axes[1].barh(y, table.s_per_iteration, color="tab:gray")
axes[1].set_yticks(y, [])
axes[1].set_ylabel("(as left)")
axes[1].set_xlabel("seconds per iteration")
axes[0].set_title("final success per variant")
axes[1].set_title("cost per iteration")
fig.tight_layout()
runs.save_figure(fig, run_path, "final_success")
plt.show()

# %% [markdown]
# ## Learning curves per category (mean over seeds, band = min..max; the baseline, black, in every panel)

# %%
scored = curves.dropna(subset=[cfg.metric])
categories = [c for c in sorted(scored.category.unique()) if c != "baseline"] or ["baseline"]
ncols = min(3, len(categories))
nrows = -(-len(categories) // ncols)
fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3 * nrows), sharey=True, squeeze=False)
for ax, cat in zip(axes.flat, categories):
    shown = scored[(scored.category == cat) | (scored.variant == "baseline")]
    for variant, c in shown.groupby("variant"):
        agg = c.groupby("step")[cfg.metric].agg(["mean", "min", "max"])
        style = {"color": "k", "lw": 1.5} if variant == "baseline" else {"lw": 1.2}
        ax.plot(agg.index, agg["mean"], label=variant, **style)
        ax.fill_between(agg.index, agg["min"], agg["max"], alpha=0.15, color=style.get("color"))
    ax.axhline(cfg.success_level, ls="--", c="gray", lw=0.8)
    ax.set_title(cat)
    ax.set_xlabel("env steps")
    ax.legend(fontsize=7)
for ax in axes.flat[len(categories):]:
    ax.set_visible(False)
axes[0, 0].set_ylabel(cfg.metric)
fig.tight_layout()
runs.save_figure(fig, run_path, "learning_curves")
plt.show()

# %% [markdown]
# ## Verdicts: each setting against the baseline, paired on the same held-out episodes
#
# Only with `evaluation` set (see the introduction); the smoke sweep has none.

# %%
verdict_rows = []
if cfg.evaluation:
    effects = verdicts.effects(REPO_ROOT / "results" / cfg.evaluation, cfg.baseline)
    effects.to_csv(run_path / "verdicts.csv", index=False)
    verdict_rows = effects.to_dict("records")
    rest = effects[effects.setting != cfg.baseline].sort_values("effect")
    fig, ax = plt.subplots(figsize=(7, 0.3 * len(rest) + 1.5))
    colours = rest.verdict.map({"helps": "tab:green", "hurts": "tab:red"}).fillna("tab:gray")
    ax.errorbar(rest.effect, np.arange(len(rest)), xerr=2 * rest.effect_se, fmt="none", ecolor=colours)
    ax.scatter(rest.effect, np.arange(len(rest)), c=colours, zorder=3)
    ax.axvline(0, c="k", lw=0.8)
    ax.set_yticks(np.arange(len(rest)), rest.setting)
    ax.set_ylabel("setting")
    ax.set_xlabel("success_once minus the baseline's, paired (mean over seeds; bars: 2 SE)")
    ax.set_title(f"{cfg.evaluation}: green helps, red hurts, grey within 2 SE")
    fig.tight_layout()
    runs.save_figure(fig, run_path, "verdicts")
    plt.show()
    print(verdicts.markdown(effects))
else:
    print("no evaluation record given: the verdicts need the sweep's checkpoints on shared episodes")

# %%
runs.save_json(run_path / "summary.json", {"sweep_dir": str(folder), "rows": table.to_dict("records"),
                                           "verdicts": verdict_rows})
print(f"report written to {run_path.relative_to(outputs_root())}")
