"""DSpark: the block drafter (backbone, Markov heads, confidence head), its round, confidence scheduler and cost model."""
