"""tiderl.control."""
