"""The main job's pieces: a synthetic task with a programmatic reward, GRPO advantages, and (``slime-rc train``) the
loop rollout -> reward -> advantages -> (recompute) -> train with rollout correction."""
