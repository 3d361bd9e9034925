"""The API process must not import torch or transformers (fast start, no CUDA in the API image)."""

import subprocess
import sys


def test_app_main_does_not_import_torch():
    code = ("import sys, app.main; app.main.create_app(); "
            "bad = [m for m in ('torch', 'transformers', 'datasets') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_core_imports_neither_fastapi_nor_torch():
    code = ("import sys, core.settings, core.db, core.rows, core.store.jobs, core.store.datasets, core.queue, "
            "core.celery_app, core.tabular, core.pretrained; "
            "bad = [m for m in ('torch', 'fastapi') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
