"""`fedkey-bench typing`: the keyboards of a population on the messages its people typed next."""
