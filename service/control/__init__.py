"""The control plane: orchestrator, runs, suites, validation, and the views the API and UI show."""
