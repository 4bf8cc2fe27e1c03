"""Engine specs: how each inference engine is installed, checked and started. Pure code."""
