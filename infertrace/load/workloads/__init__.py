"""What a run sends: datasets of prompts, trace replay, multi-turn sessions, arrival schedules and ramp-up."""
