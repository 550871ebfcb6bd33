"""MTP / EAGLE-1 style chain drafter: the baseline arm of the benchmarks (SGLang EAGLE 1-1-2, 3-1-4)."""

from dspark_jax.mtp.draft import ChainDraft, build_draft_batch, draft_chain, draft_keys
from dspark_jax.mtp.model import (
    MTPConfig,
    MTPDrafter,
    allocate_mtp_cache,
    load_mtp,
    mtp_state_dict,
    save_mtp,
    spec_config,
    stored_num_steps,
)

__all__ = ["ChainDraft", "MTPConfig", "MTPDrafter", "allocate_mtp_cache", "build_draft_batch", "draft_chain",
           "draft_keys", "load_mtp", "mtp_state_dict", "save_mtp", "spec_config",
           "stored_num_steps"]
