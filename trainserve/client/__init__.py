"""The `trainserve` client commands: talk to a running service over HTTP (upload, train, follow, jobs, chat)."""

# How each job status is coloured in tables, progress bars and summaries (rich markup styles).
STATUS_STYLE = {"succeeded": "green", "failed": "red", "cancelled": "yellow", "running": "cyan", "queued": "dim"}
# Short names of the metrics shown in tables and progress bars.
SHORT_METRICS = {"train_loss": "loss", "eval_loss": "eval", "eval_accuracy": "acc", "eval_f1": "f1"}
