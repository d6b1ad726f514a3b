"""Layout planner: which (dp_replicate, dp_shard, cp, tp) layout to train a model on, and why."""
