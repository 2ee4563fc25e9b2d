"""The chunked delta-rule core shared by gdn and kda (see common.py)."""
