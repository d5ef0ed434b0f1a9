"""What both ends of the wire share: the round task and its codec, the training and data configs,
text normalization and the noise a phone adds. Imports only the standard library, numpy and torch."""
