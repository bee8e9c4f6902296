"""Decode throughput: the decode-only window, the maximum-batch search and the roofline."""
