"""One file per parallel strategy; each exposes an ``apply_*`` function that knows nothing of config files."""
