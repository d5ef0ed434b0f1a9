"""`fedkey-bench load`: the federation server under thousands of fake phones, with its report."""
