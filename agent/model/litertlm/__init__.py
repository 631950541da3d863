"""LiteRT-LM's `.litertlm` bundles: sections, metadata, and the cache they are extracted into."""
