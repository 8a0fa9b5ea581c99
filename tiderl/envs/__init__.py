"""tiderl.envs."""
