"""The bottom of search/: a trial's record, the study's settings, the trial count across workers
and the overrides a trial composes from. Imports nothing else of search/."""
