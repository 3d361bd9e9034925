"""The client subcommands of `trainserve`: upload, train, follow, jobs, chat; each talks to a running service."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

from core.generation_limits import CHAT
from core.jobspec import DEFAULT_KIND, KINDS, load_kind_modules
from core.vocab import JobStatus
from trainserve.client import SHORT_METRICS, STATUS_STYLE
from trainserve.client.api import Api, ApiError
from trainserve.client.config import ConfigError, load_config
from trainserve.client.text import plain, visible

if TYPE_CHECKING:  # rich is imported when a client command runs, not when `trainserve worker` starts
    from rich.console import Console

FLAGS = ("epochs", "max_steps", "batch_size", "learning_rate", "max_length")  # hyperparameters with a flag of their own


def _api(args: argparse.Namespace) -> Api:
    return Api(load_config(args.url, args.api_key))


def _upload(api: Api, args: argparse.Namespace, console: Console) -> int:
    path = Path(args.file)
    with path.open("rb") as handle:
        dataset = api.call("POST", "/datasets", files={"file": (path.name, handle)},
                           data={"name": args.name} if args.name else {}, timeout=300)
    if args.quiet:  # the id alone, for scripts: ds=$(trainserve upload -q train.csv)
        print(visible(dataset["id"]))
    else:
        console.print(f"[green]uploaded[/] {plain(dataset['id'])}  {plain(dataset['rows'])} rows, columns "
                      f"{plain(', '.join(map(str, dataset['columns'])))}")
    return 0


def job_spec(args: argparse.Namespace) -> dict[str, Any]:
    """POST /jobs body from the flags (a --spec file is the base; flags override its fields)."""
    spec: dict[str, Any] = json.loads(Path(args.spec).read_text()) if args.spec else {}
    spec.setdefault("task", args.task)
    for flag, field in (("dataset", "train_dataset"), ("eval_dataset", "eval_dataset"),
                        ("base_model", "base_model"), ("text_column", "text_column"),
                        ("label_column", "label_column")):
        if getattr(args, flag) is not None:
            spec[field] = getattr(args, flag)
    hyper = spec.setdefault("hyperparameters", {})
    for name in FLAGS:
        if getattr(args, name) is not None:
            hyper[name] = getattr(args, name)
    for item in args.set or []:
        name, _, value = item.partition("=")
        hyper[name] = _value(value)
    if "train_dataset" not in spec:
        raise ConfigError("train needs --dataset (or train_dataset in --spec)")
    return spec


def _value(text: str) -> Any:
    """A --set value: JSON when it parses (numbers, true, lists), else the text itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _train(api: Api, args: argparse.Namespace, console: Console) -> int:
    job = api.call("POST", "/jobs", json=job_spec(args))
    if args.detach and args.quiet:
        print(visible(job["id"]))
        return 0
    console.print(f"[green]started[/] {plain(job['id'])}  ({plain(job['task'])} on "
                  f"{plain(job['base_model'] or 'a new model')})")
    if args.detach:
        return 0
    args.job_id = job["id"]
    return _follow(api, args, console)


def _follow(api: Api, args: argparse.Namespace, console: Console) -> int:
    from trainserve.client.follow import follow, summary  # imports rich

    state = follow(api, args.job_id, console)
    console.print(f"{plain(args.job_id)} {summary(state)}")
    return 0 if state.get("status") == "succeeded" else 1


def _jobs(api: Api, args: argparse.Namespace, console: Console) -> int:
    params = {"limit": args.limit, **({"status": args.status} if args.status else {})}
    from rich.table import Table

    page = api.call("GET", "/jobs", params=params)
    table = Table(box=None)
    table.add_column("id", no_wrap=True, style="bold")
    table.add_column("status", no_wrap=True)
    for name in ("task", "base model", "step", "metrics", "created"):
        table.add_column(name, overflow="fold")
    for job in page["data"]:
        progress, status = job["progress"], job["status"]
        metrics = " ".join(f"{short} {job['metrics'][k]:.3g}" for k, short in SHORT_METRICS.items()
                           if k in job["metrics"])
        base = str(job["base_model"] or "-")
        table.add_row(plain(job["id"]), f"[{STATUS_STYLE.get(status, 'white')}]{plain(status)}[/]", plain(job["task"]),
                      plain(base.rsplit("/", 1)[-1] if base.startswith("/") else base),
                      plain(f"{progress['step']}/{progress['total_steps'] or '?'}"), plain(metrics),
                      plain(job["created_at"][5:16].replace("T", " ")))
    console.print(table)
    return 0


def _chat(api: Api, args: argparse.Namespace, console: Console) -> int:
    from trainserve.client.chat import chat

    return chat(api, console, sys.stdin, model=args.model, system=args.system, max_tokens=args.max_tokens,
                temperature=args.temperature)


def _run(handler: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        from rich.console import Console

        console = Console(stderr=False, highlight=False, emoji=False)
        errors = Console(stderr=True, highlight=False, emoji=False)
        try:
            api = _api(args)
        except ConfigError as exc:
            errors.print(f"[red]error:[/] {plain(exc)}")
            return 2
        try:
            return int(handler(api, args, console))
        except (ApiError, ConfigError, OSError, ValueError) as exc:
            errors.print(f"[red]error:[/] {plain(exc)}", markup=True, highlight=False)
            return 2 if isinstance(exc, ConfigError) else 1
        except KeyboardInterrupt:
            errors.print("[yellow]interrupted[/] (a started job keeps running; `trainserve follow` resumes)")
            return 130
        finally:
            api.close()
    return run


def kind_choices() -> list[str]:
    """The job kinds `train --task` offers: those registered once TRAINSERVE_JOB_KIND_MODULES is imported."""
    from core.settings import get_settings

    load_kind_modules(get_settings().job_kind_module_names)
    return list(KINDS)


def hyperparameter_flag(name: str) -> tuple[type, str]:
    """The type and help of a hyperparameter's flag, read from the registered kinds' models that have the field
    (a float where one kind takes a float and another an int); ValueError when no kind has it or kinds disagree."""
    fields = [kind.hyperparameters.model_fields[name] for kind in KINDS.values()
              if name in kind.hyperparameters.model_fields]
    types = {member for field in fields for member in get_args(field.annotation) or (field.annotation,)
             if member is not type(None)}
    if types == {int, float}:
        types = {float}
    if len(types) != 1:
        raise ValueError(f"hyperparameter {name} has no one scalar type across the job kinds: {types or 'none'}")
    (kind,) = types
    described = [field.description for field in fields if field.description]
    return kind, described[0] if described else ""


def register(sub: Any) -> None:
    """Add the client subcommands to the `trainserve` parser."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=None, help="the service (default $TRAINSERVE_URL, the config file, or "
                        "http://127.0.0.1:8000)")
    common.add_argument("--api-key", default=None, help="default $TRAINSERVE_API_KEY or the config file's api_key")
    upload = sub.add_parser("upload", parents=[common], help="upload a dataset file (CSV, TSV, JSONL, TXT)")
    upload.add_argument("file")
    upload.add_argument("--name", default=None)
    upload.add_argument("-q", "--quiet", action="store_true", help="print only the dataset's id")
    upload.set_defaults(func=_run(_upload))
    train = sub.add_parser("train", parents=[common], help="start a fine-tune and follow it live")
    train.add_argument("--dataset", default=None, help="id of the training dataset")
    train.add_argument("--eval-dataset", default=None)
    train.add_argument("--task", default=DEFAULT_KIND, choices=kind_choices(),
                       help="the job's kind (those TRAINSERVE_JOB_KIND_MODULES adds too)")
    train.add_argument("--base-model", default=None, help="e.g. minilm-l6, a hub id, or a finished job's id")
    train.add_argument("--text-column", default=None)
    train.add_argument("--label-column", default=None)
    for name in FLAGS:
        kind, description = hyperparameter_flag(name)
        train.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None,
                           help=description.replace("%", "%%"))  # argparse formats help with %
    train.add_argument("--set", action="append", metavar="NAME=VALUE", help="any other hyperparameter")
    train.add_argument("--spec", default=None, help="a JSON file with a whole POST /jobs body")
    train.add_argument("--detach", action="store_true", help="start it and return at once")
    train.add_argument("-q", "--quiet", action="store_true", help="with --detach: print only the job's id")
    train.set_defaults(func=_run(_train))
    follow = sub.add_parser("follow", parents=[common], help="follow a job live (progress, loss, events)")
    follow.add_argument("job_id")
    follow.set_defaults(func=_run(_follow))
    jobs = sub.add_parser("jobs", parents=[common], help="list jobs, newest first")
    jobs.add_argument("--status", default=None, choices=list(JobStatus))
    jobs.add_argument("--limit", type=int, default=20)
    jobs.set_defaults(func=_run(_jobs))
    chat = sub.add_parser("chat", parents=[common], help="chat with a served model (streams each reply)")
    chat.add_argument("model")
    chat.add_argument("--system", default=None, help="a system message")
    chat.add_argument("--max-tokens", type=int, default=None,
                      help=f"tokens per reply at most (default: the server's, {CHAT.default})")
    chat.add_argument("--temperature", type=float, default=0.7)
    chat.set_defaults(func=_run(_chat))
