"""`python -m search.fit`: the command-line name of batchfit's fit report (`batchfit fit`)."""
