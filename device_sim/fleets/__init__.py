"""Fleets of phones over HTTP: threads on this machine, or asyncio tasks on Ray."""
