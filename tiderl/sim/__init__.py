"""tiderl.sim."""
