"""Runtime layer: the only code that talks to LiteRT and SentencePiece."""
