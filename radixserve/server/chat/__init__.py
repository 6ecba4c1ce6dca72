"""What both chat APIs share: rendering messages and tools for the template, tool-call parsing,
the reasoning split."""
