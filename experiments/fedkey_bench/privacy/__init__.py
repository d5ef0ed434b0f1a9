"""`fedkey-bench privacy`: the privacy-utility table, with its report."""
