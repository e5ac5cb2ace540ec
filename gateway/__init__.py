"""batchery serve: an OpenAI-compatible HTTP gateway over batchery's queues."""
