"""Tokenizers: the interface, SentencePiece and Hugging Face kinds, and their vocabularies."""
