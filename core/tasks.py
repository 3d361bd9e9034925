"""Celery task names and queues: the API enqueues by name, so it never imports the worker."""

TASK_TRAIN = "worker.tasks.train"
TASK_CLASSIFY = "worker.tasks.classify"

QUEUE_TRAIN = "training"
QUEUE_INFERENCE = "inference"
TASK_GENERATE = "worker.tasks.generate"
QUEUE_GENERATE = "generation"


def stream_key(request_id: str) -> str:
    """Redis stream a generation worker writes a request's events to."""
    return f"trainserve:gen:{request_id}"


def cancel_key(request_id: str) -> str:
    """Redis key the API sets when a client goes away, so the worker frees the request's batch slot."""
    return f"trainserve:gen:{request_id}:cancel"


def classify_reply_key(request_id: str) -> str:
    """Redis list an inference worker pushes a /classify call's result to."""
    return f"trainserve:classify:{request_id}:reply"


def abandoned_key(request_id: str) -> str:
    """Redis key the API sets when it stops waiting, so a worker skips the task instead of running it."""
    return f"trainserve:classify:{request_id}:abandoned"
