"""Speculative decoding: one folder per algorithm (dspark, mtp) and what they share (common)."""
