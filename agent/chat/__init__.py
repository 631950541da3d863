"""Chat: messages and tools to prompt tokens through a template, and tool calls read back."""
