"""Who sends and when: the closed and open loops of one process, and the load workers (local processes, Ray
actors) that share one schedule."""
