"""Model implementations the engine can run."""
