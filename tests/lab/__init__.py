"""Tests of the emulated fleet (the lab itself is edgefleet.lab)."""
