"""`fedkey-bench peers`: fedkey against Flower and pfl-research on the same workload."""
