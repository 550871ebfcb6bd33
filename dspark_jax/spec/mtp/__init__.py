"""MTP / EAGLE-style chain drafter: the baseline arm (SGLang EAGLE 1-1-2, 3-1-4)."""
