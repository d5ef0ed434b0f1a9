"""Pieces every benchmark shares: the checkout and its paths, running a fedkey command as a recorded run, markdown tables, the machine and commit a figure came from."""
