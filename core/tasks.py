"""Celery task names and queues: the API enqueues by name, so it never imports the worker."""

TASK_TRAIN = "worker.tasks.train"
TASK_CLASSIFY = "worker.tasks.classify"

QUEUE_TRAIN = "training"
QUEUE_INFERENCE = "inference"
