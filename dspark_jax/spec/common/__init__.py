"""What the speculative algorithms share: acceptance rules, ragged packing, token tiers, round statistics."""
