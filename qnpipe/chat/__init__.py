"""Tokenizer loading and chat-template rendering."""
