"""Conversations: the OpenAI wire format in and out, append-only rendering, the records each turn extends,
and who is asking (tenants, cache salts)."""
