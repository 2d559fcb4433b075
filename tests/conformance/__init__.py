"""Conformance tests: edgefleet's data-parallel training against plain single-process Lightning."""
