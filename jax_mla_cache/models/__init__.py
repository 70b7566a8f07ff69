"""Small models that run on the cache (demos and integration tests)."""
