"""tiderl.train."""
