"""What drives both sides at once: the in-process simulation, centralized and n-gram baselines,
and the supervision of the server, fleet and keyboard processes for `fedkey run` and `fedkey demo`."""
