"""What a run shows: progress lines, experiment trackers, alerts on its iterations, and its curves."""
