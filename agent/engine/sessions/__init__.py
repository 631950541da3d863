"""Sessions: one conversation's tokens and KV, and the tiers it moves through."""
