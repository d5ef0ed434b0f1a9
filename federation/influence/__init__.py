"""Bounded influence: what the server does to a round's updates before any strategy."""
