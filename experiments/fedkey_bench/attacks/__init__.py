"""`fedkey-bench attacks`: malicious phones against the server's defences, with its report."""
