"""The `trainserve` client commands: talk to a running service over HTTP (upload, train, follow, jobs, chat)."""

# How each job status is coloured in tables, progress bars and summaries (rich markup styles).
STATUS_STYLE = {"succeeded": "green", "failed": "red", "cancelled": "yellow", "running": "cyan", "queued": "dim"}
