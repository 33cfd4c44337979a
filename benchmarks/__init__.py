"""mlmkit's benchmarks: each compares mlmkit with a baseline side by side in one run (`make bench`)."""
