"""What a study concludes from its trials: the speed check, critical batch and time to target, the
recommendation, the memory boundary, the summary and the plots."""
