"""Launchers above the loop: the ranks of a data-parallel run (torch.distributed), and the
speed probe that times configurations side by side."""
