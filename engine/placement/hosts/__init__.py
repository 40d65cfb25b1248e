"""GPU hosts reached over SSH: the host agent, its link from the dispatch host, its readings."""
