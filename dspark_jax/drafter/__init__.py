"""DSpark block drafter: KV-injection backbone, sequential (Markov) heads, confidence head."""
