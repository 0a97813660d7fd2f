"""swerve's service: store, fleet, worker, control plane, api and ui, composed by the entry layer
(app.py, cli.py, embedded.py). It never imports the trainer, which runs as its own process."""
