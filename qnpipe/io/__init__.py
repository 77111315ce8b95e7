"""Expert store layout, the real SSD reader and (later) the simulated SSD."""
