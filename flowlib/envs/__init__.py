"""envs: tasks, simulators, demonstrations (imports infra and flows).

    tasks           what is particular to each task, in one table (episode length, control mode, demo settings)
    maniskill       ManiSkill3 envs behind a batched torch interface (physx_cuda, or AsyncVectorEnv on CPU);
                    ``make_env`` for every backend
    metaworld_envs  Meta-World v3 (MuJoCo) tasks: seeded positions per episode, worker groups, the scripted experts
    fast_envs       thousands of planar envs stepped as torch tensors (FastReach, FastPush), behind make_env's interface
    fast_avoid      FastAvoid-v0: reach a goal past an obstacle, around either side (demos with two modes)
    fast_tasks      the fast tasks by name (FAST_TASKS) and their demonstrators
    vector          gymnasium's vector envs as the CPU simulators use them; EnvGroups, a group of envs per worker
    visual          RGB(-D) images and point clouds as packed observation vectors, from the env and from demos
    visual_demos    the state demos rendered into a visual obs mode, and their training windows
    data            motion-planning and expert demos, trajectory files, normalisers, chunk windows
    smdp            action chunks as a semi-MDP: ChunkRunner steps N envs a chunk at a time, with the rewards learning sees

Until the next release ``flowlib.envs.make_env`` (the old flat module's names) still resolves, with a FutureWarning
that names ``flowlib.envs.maniskill``.
"""
from flowlib._moved import old_names_of

__getattr__ = old_names_of("flowlib.envs", "flowlib.envs.maniskill")
