"""Routing: key -> bucket (pure hashing), bucket -> shard (placement)."""
