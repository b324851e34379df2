"""The study on top: creation or resumption, the driver and its workers, the checks before trial 0,
the decisions made once per study, what it publishes as it goes, and multirun."""
