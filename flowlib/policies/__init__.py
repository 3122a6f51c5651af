"""policies: stage 1 and stage 2, and the policy every stage loads (imports infra, flows, envs).

    chunk_policy  the chunk-policy protocol, stage 1's FlowPolicy and the checkpoint format every stage loads
    encoders      observation encoders for pixels and points (a velocity net's obs_encoder)
    policy_eval   scoring any chunk policy on held-out episodes
    bc            stage 1: ShortCut BC's config, demos and training loop (bc.<name> still reaches chunk_policy's)
    critic        chunk-level semi-MDP transitions, IQL / Monte-Carlo critics, AWR weights, RFC masks
    awsc          stage 2: AW-ShortCut data with contrast, load_from_aw_shortcut_flow
"""
