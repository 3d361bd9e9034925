"""Celery task names and queues: the API enqueues by name, so it never imports the worker."""

TASK_TRAIN = "worker.tasks.train"
TASK_CLASSIFY = "worker.tasks.classify"
TASK_EMBED = "worker.tasks.embed"

QUEUE_TRAIN = "training"
QUEUE_INFERENCE = "inference"
TASK_GENERATE = "worker.tasks.generate"
QUEUE_GENERATE = "generation"
# /v1/batches run on the generation queue: they share the engines (and the batcher) of interactive requests.
TASK_BATCH = "worker.tasks.batch"
MAX_JOB_DEVICES = 64  # most devices one job may ask for on each node (one host's GPUs)
MAX_JOB_NODES = 16  # most hosts one job may span (workers that join one rendezvous: worker.jobs.gang)
# A job on several nodes: the worker that claimed it (the head) calls one more worker per node with this task, on
# the training queue of the job's size, so only a worker that owns enough devices answers.
TASK_JOIN = "worker.tasks.join"


def train_queue(devices: int) -> str:
    """The training queue of a job on `devices` devices: "training", or "training.N" only workers owning N consume."""
    return QUEUE_TRAIN if devices <= 1 else f"{QUEUE_TRAIN}.{devices}"


def train_queues(owned: int) -> list[str]:
    """The training queues a worker owning `owned` devices consumes: every job size it can run."""
    return [train_queue(n) for n in range(1, owned + 1)]

