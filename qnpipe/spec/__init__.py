"""MTP self-speculative decoding: draft with the MTP head, verify with the main model, roll back."""
