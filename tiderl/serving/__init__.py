"""tiderl.serving."""
