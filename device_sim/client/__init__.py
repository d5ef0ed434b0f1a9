"""The phone's HTTP client: blocking and asyncio, and its decisions on a round's view."""
