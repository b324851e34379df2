"""Where a study lives (an Optuna journal file or an RDB), how its workers notice that one of them
died, and the lock under which the study's end is decided once."""
