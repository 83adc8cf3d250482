"""Programs from the CoCoNeT paper, shipped as examples (and used by the demo and the tests)."""
