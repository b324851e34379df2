"""`python -m train`: the command-line name of batchfit's single run (`batchfit train`).

The training library itself is `batchfit.train`; this package only gives it the short
`python -m` name, and imports nothing else.
"""
