"""Simulated phones: local training and its backends (training/), the HTTP client (client/), fleets
of phones (fleets/), malicious phones and joining a Ray cluster."""
