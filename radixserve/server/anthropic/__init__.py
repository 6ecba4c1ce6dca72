"""Anthropic's Messages API over the same chat path."""
