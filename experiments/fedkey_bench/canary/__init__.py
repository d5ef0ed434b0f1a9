"""`fedkey-bench canary`: the canary audit on the privacy table's population, and the product audit's page."""
