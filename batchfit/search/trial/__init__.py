"""One trial: its configuration re-composed with its sampled values, the objective that trains it,
when it stops early, and how it ended, recorded."""
