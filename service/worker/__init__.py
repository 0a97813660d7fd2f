"""Rollout workers: the Celery task, the runtime, the episode executor and the agent loop."""
